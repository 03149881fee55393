// LIT_MULTIVERSION: compile a function for AVX-512, AVX2 and the baseline x86-64; GCC's target_clones picks one
// when the library loads, so the hot loops use the CPU's widest vectors while the package still loads on any
// x86-64 CPU. Elsewhere (other compilers or architectures) it expands to nothing.
//
// Only for plain (non-template) functions, and only where a fused multiply-add may replace a multiply and an
// add: the AVX-512 and AVX2 clones may contract them, which changes float results in the last bit.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define LIT_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LIT_MULTIVERSION
#endif

// bfloat16 <-> float on the raw bits, inline, so that loops over them vectorise in every LIT_MULTIVERSION clone
// (c10::BFloat16's own conversions are not always inlined into vector code).
#pragma once

#include <cstdint>
#include <cstring>

namespace lit_amp_det {
namespace ops {

// bf16 is the upper half of a float: exact.
inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &word, sizeof(float));
  return out;
}

// Rounds to nearest even and keeps NaN a (quiet) NaN, as c10::BFloat16's constructor does.
inline uint16_t float_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(float));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return nan ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

}  // namespace ops
}  // namespace lit_amp_det

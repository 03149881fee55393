"""glibc's heap policy for this process: hand freed memory back to the OS, or keep it for the next step.

On a CPU every tensor comes from glibc's ``malloc``. By default glibc serves large blocks with ``mmap`` and returns
them (and the free top of its heap) to the OS when they are freed, so a training step that frees and reallocates
the same activations every iteration faults every page of them in again: the kernel zeroes each 4 KB page and
both threads wait on the process's memory map. Whether a process falls into that pattern depends on the order of
its first allocations (glibc adapts its thresholds to the blocks it has seen freed). Measured on the R50-FPN at
256 px, batch 2, on the 2-core dev CPU: processes of the same step took 0-600 or 6 800-27 800 faults a step, and
those above 20 000 ran 15-25 % slower (BENCHMARKS.md, "Retained CPU heap").

:func:`retain_freed_memory` turns that off for the process: no ``mmap`` for large blocks and no trimming, so a
freed block stays mapped and the next step reuses it without faults; the resident set stays at the run's peak (what
CUDA's caching allocator does with device memory). A few faults a step remain where a request fits no freed block:
torch allocates with ``posix_memalign``, which asks glibc for a little more than the size, so a freed block of exactly
that size is not always reused for the same request (retained R50 steps: 300-2 200 faults instead of up to 35 000).
:func:`return_freed_memory` restores glibc's behaviour. The callback
:class:`~lit_amp_det.callbacks.retain_cpu_heap.RetainCPUHeap` applies it for a CPU run.

The measurement helpers :func:`pin_malloc_threshold` / :func:`unpin_malloc_threshold` (the benches' peak memory of
one step) live here too, since they change the same settings; unpinning restores whichever policy was in force.
Without glibc (macOS, musl) every function does nothing. Imports only the standard library.
"""

from __future__ import annotations

import ctypes
import gc
import sys

__all__ = [
    "heap_in_use_bytes",
    "pin_malloc_threshold",
    "release_freed_cpu_memory",
    "retain_freed_memory",
    "retains_freed_memory",
    "return_freed_memory",
    "unpin_malloc_threshold",
]


def _load_libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


_LIBC = _load_libc()

#: glibc's ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
#: Where glibc's dynamic mmap threshold ends up in a process that has freed large blocks (DEFAULT_MMAP_THRESHOLD_MAX
#: on 64-bit); the dynamic trim threshold is twice the mmap threshold.
_GLIBC_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024
#: glibc's default cap on the number of mmap'd blocks (DEFAULT_MMAP_MAX); 0 serves every block from the heap.
_GLIBC_MMAP_MAX = 65536
#: ``mallopt`` takes a C int: the largest trim threshold, i.e. never trim.
_NEVER_TRIM = 2**31 - 1

_retained = False


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33+)."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_MALLINFO2 = getattr(_LIBC, "mallinfo2", None)
if _MALLINFO2 is not None:
    _MALLINFO2.restype = _MallInfo2


def heap_in_use_bytes() -> int | None:
    """Bytes of live ``malloc`` blocks (heap and mmap'd, glibc's ``mallinfo2``): what the process holds, without the
    freed memory glibc keeps. None without glibc 2.33+."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


def _mallopt(param: int, value: int) -> bool:
    mallopt = getattr(_LIBC, "mallopt", None)
    return mallopt is not None and mallopt(param, value) == 1


def retains_freed_memory() -> bool:
    """True while :func:`retain_freed_memory` is in force."""
    return _retained


def retain_freed_memory() -> bool:
    """Makes glibc keep freed memory mapped for reuse: no ``mmap`` per large block, no trimming of the heap.

    Later steps then reuse the pages earlier steps touched, without page faults; the resident set never shrinks
    below the largest heap the process has had. Returns False (and changes nothing) where glibc's ``mallopt`` is
    not available."""
    global _retained
    if not (_mallopt(_M_MMAP_MAX, 0) and _mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)):
        return False
    _retained = True
    return True


def _long_running_thresholds() -> None:
    _mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX)
    _mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD_MAX)
    _mallopt(_M_TRIM_THRESHOLD, 2 * _GLIBC_MMAP_THRESHOLD_MAX)


def return_freed_memory() -> None:
    """Undoes :func:`retain_freed_memory` as far as glibc allows (large blocks mmap'd again, thresholds where its own
    adjustment takes them in a long-running process: mmap 32 MB, trim 64 MB) and hands the free heap back now."""
    global _retained
    if _retained:
        _long_running_thresholds()
        _retained = False
        release_freed_cpu_memory()


def release_freed_cpu_memory() -> None:
    """Returns freed heap to the OS, so a resident-set peak measures this step, not the last one's leftovers."""
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None)  # glibc; musl has none
    if trim is not None:
        trim(0)


def pin_malloc_threshold(threshold: int = 128 * 1024) -> None:
    """Makes glibc hand large frees back to the OS (otherwise its mmap threshold grows and RSS stays up).

    Every later allocation above ``threshold`` then gets fresh pages from the OS, which costs page faults: call
    :func:`unpin_malloc_threshold` when the measurement is over, in a process that goes on working.
    """
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is None or not _mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX):
        return
    _mallopt(_M_MMAP_THRESHOLD, threshold)  # fixed, so it no longer adapts upwards
    trim(0)


def unpin_malloc_threshold() -> None:
    """Undoes :func:`pin_malloc_threshold`: back to :func:`retain_freed_memory` if that was in force, otherwise to
    glibc's long-running thresholds (mmap 32 MB, trim 64 MB; its own adjustment stays off)."""
    if _retained:
        _mallopt(_M_MMAP_MAX, 0)
        _mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)
    else:
        _long_running_thresholds()

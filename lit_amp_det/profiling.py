"""How lit_amp_det measures: peak memory, bytes saved for backward, step time and images per batch.

The callbacks (``MemoryMonitor``, ``Throughput``, ``RunStats``), the benches and the tasks all measure through
this one module, so a figure means the same thing wherever it is printed. It imports only the standard library and
torch, so any layer may use it."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import resource
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["MB", "HostSyncs", "MemoryProbe", "SavedTensorBytes", "StepTimer", "count_images", "pin_malloc_threshold",
           "release_freed_cpu_memory", "synchronize", "timed", "unpin_malloc_threshold"]

MB = 2**20


# ------------------------------------------------------------------------------------------- CPU memory
def _proc_status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (Linux), or None where there is none."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def _reset_cpu_high_water_mark() -> bool:
    """Resets the process's peak resident set (``VmHWM``) to its current size; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


# ------------------------------------------------------------------------------------- glibc's heap policy
# A resident-set peak on a CPU counts the pages glibc keeps after a free: a measurement first hands them back.
_LIBC: ctypes.CDLL | None = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError):
        _LIBC = ctypes.CDLL("libc.so.6")
#: glibc's ``mallopt`` parameters (malloc.h) and its defaults for a long-running process (64-bit).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_GLIBC_MMAP_THRESHOLD_MAX, _GLIBC_MMAP_MAX = 32 * 1024 * 1024, 65536


def _mallopt(param: int, value: int) -> bool:
    mallopt = getattr(_LIBC, "mallopt", None)
    return mallopt is not None and mallopt(param, value) == 1


def release_freed_cpu_memory() -> None:
    """Returns freed heap to the OS, so a resident-set peak measures this step, not the last one's leftovers."""
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None)  # glibc; musl has none
    if trim is not None:
        trim(0)


def pin_malloc_threshold(threshold: int = 128 * 1024) -> None:
    """Makes glibc hand large frees back to the OS (otherwise its mmap threshold grows and the resident set stays
    up), so that consecutive peaks are comparable. Costs page faults: :func:`unpin_malloc_threshold` afterwards."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is None or not _mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX):
        return
    _mallopt(_M_MMAP_THRESHOLD, threshold)  # fixed, so it no longer adapts upwards
    trim(0)


def unpin_malloc_threshold() -> None:
    """Undoes :func:`pin_malloc_threshold`: glibc's thresholds for a long-running process."""
    _mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX)
    _mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD_MAX)
    _mallopt(_M_TRIM_THRESHOLD, 2 * _GLIBC_MMAP_THRESHOLD_MAX)


# --------------------------------------------------------------------------------------------- the probe
class MemoryProbe:
    """Peak and in-use memory of one device: the CUDA caching allocator, or this process on a CPU.

    On a CPU the peak is the process's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``); where
    that is not allowed, ``ru_maxrss``, which only grows (``resettable`` False). ``source`` names what is measured."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.source, self.resettable = "CUDA allocator (max_memory_allocated)", True
        elif _proc_status_kib("VmHWM") is not None and _reset_cpu_high_water_mark():
            self.source, self.resettable = "process VmHWM (reset per step via /proc/self/clear_refs)", True
        else:
            self.source, self.resettable = "process ru_maxrss (peak since start: not resettable here)", False

    def synchronize(self) -> None:
        synchronize(self.device)

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            _reset_cpu_high_water_mark()

    def peak_bytes(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device)
        if self.resettable:
            return 1024 * (_proc_status_kib("VmHWM") or 0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else 1024 * peak  # bytes on macOS, KiB on Linux

    def peak_reserved_bytes(self) -> int | None:
        return torch.cuda.max_memory_reserved(self.device) if self.cuda else None

    def in_use_bytes(self) -> int | None:
        """Allocated tensor memory (CUDA) or the resident set (CPU); None where it cannot be read."""
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        rss = _proc_status_kib("VmRSS")
        return None if rss is None else 1024 * rss

    def baseline_bytes(self) -> int:
        """What a later peak is measured above: in use now, or the peak so far where the peak cannot be reset."""
        in_use = self.in_use_bytes()
        return in_use if self.resettable and in_use is not None else self.peak_bytes()


# ------------------------------------------------------------------------------------ saved for backward
class SavedTensorBytes:
    """Counts the bytes autograd saves for backward while the context is open.

    Each distinct storage is counted once, whole (a saved view keeps all of it alive); storages of ``exclude`` (the
    parameters and buffers, resident anyway) are not counted. Of the total, ``weight_cast_bytes`` are dtype copies
    of trainable parameters (autocast's low-precision weight copies), and ``within_bytes`` are storages first saved
    during the forward of the module ``within``. It only observes, and counts tensors, not allocator blocks."""

    def __init__(self, exclude: Iterable[Tensor] = (), within: nn.Module | None = None) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._within = within
        self._inside = False
        self._seen: set[int] = set()
        self.bytes = 0
        self.weight_cast_bytes = 0
        self.within_bytes = 0
        self._stack = contextlib.ExitStack()

    def _pack(self, tensor: Tensor) -> Tensor:
        if tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()  # saved tensors stay alive until backward: pointers are not reused
            if pointer and pointer not in self._exclude and pointer not in self._seen:
                self._seen.add(pointer)
                self.bytes += storage.nbytes()
                if self._inside:
                    self.within_bytes += storage.nbytes()
                fn = tensor.grad_fn  # a dtype copy of a trainable parameter? (autocast's low-precision weight copies)
                if fn is not None and fn.name() == "ToCopyBackward0" and any(
                        isinstance(getattr(f, "variable", None), nn.Parameter) for f, _ in fn.next_functions):
                    self.weight_cast_bytes += storage.nbytes()
        return tensor

    def _enter_within(self, *_: Any) -> None:
        self._inside = True

    def _leave_within(self, *_: Any) -> None:
        self._inside = False

    def __enter__(self) -> SavedTensorBytes:
        if self._within is not None:
            self._stack.callback(self._within.register_forward_pre_hook(self._enter_within).remove)
            self._stack.callback(self._within.register_forward_hook(self._leave_within).remove)
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)


# ---------------------------------------------------------------------------------------------- timing
def synchronize(device: torch.device | str) -> None:
    """Waits for the kernels queued on a CUDA device (a no-op elsewhere): time the work, not its launch."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device | str) -> float:
    """Seconds ``fn()`` took, CUDA synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


class StepTimer:
    """Times steps from :meth:`start` to :meth:`stop`, CUDA synchronised at both ends; the first ``warmup``
    steps are not timed (allocator growth, autotuning, lazy optimizer state). ``clock`` is swappable for tests."""

    def __init__(self, device: torch.device | str, warmup: int = 0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.device = torch.device(device)
        self.warmup = warmup
        self.clock = clock
        self.steps_seen = 0
        self._started: float | None = None

    def start(self) -> bool:
        """Starts timing this step; False (and nothing read) for a warm-up step."""
        self._started = None
        if self.steps_seen < self.warmup:
            return False
        synchronize(self.device)
        self._started = self.clock()
        return True

    def stop(self) -> float | None:
        """Seconds since :meth:`start`, or None for a warm-up step; counts the step either way."""
        self.steps_seen += 1
        if self._started is None:
            return None
        synchronize(self.device)
        seconds = self.clock() - self._started
        self._started = None
        return seconds


# ---------------------------------------------------------------------------------------------- images
def count_images(batch: Any) -> int:
    """Images in a detection batch ``(images, targets)``: ``[3, H, W]`` tensors in a sequence, or ``[N, 3, H, W]``."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        images = batch[0]
        if isinstance(images, torch.Tensor) and images.dim() == 4:
            return int(images.shape[0])
        if isinstance(images, Sequence) and not isinstance(images, (str, bytes)):
            return len(images)
    kind = type(batch).__name__
    length = f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""
    raise TypeError(f"Throughput counts images in (images, targets) batches, but the training batch is a "
                    f"{kind}{length}; pass Throughput(batch_size_fn=...) returning the number of images of your "
                    "batches")


# ------------------------------------------------------------------------------------- host synchronisations
_aten = torch.ops.aten
#: ops that read a tensor's values on the host, or size their output by them: on a GPU each waits for the queued
#: kernels (and breaks a ``torch.compile`` graph, and forbids CUDA-graph capture); mask indexing is a nonzero inside
_VALUE_READS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default,
                _aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default,
                _aten.unique_consecutive.default, _aten.unique_dim.default, _aten.repeat_interleave.Tensor,
                _aten.item.default, _aten.where.default, _aten.nonzero_numpy.default}  # whole under inference_mode
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}
_TORCH_DIR = str(Path(torch.__file__).parent) + "/"


def _syncs(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    if func in _VALUE_READS:
        return func is not _aten.repeat_interleave.Tensor or kwargs.get("output_size") is None
    return func in _INDEXING and any(isinstance(i, Tensor) and i.dtype == torch.bool for i in args[1] or ())


def _call_site() -> str:
    """``path:line`` of the innermost frame outside torch and this module: the code that asked for the value."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


class HostSyncs(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts, while active, the aten calls that make the host wait for a device's values, by (op, call site). CPU
    tensors dispatch them as CUDA ones do, so a CPU run shows where a GPU step would stop: ``.item()``, ``bool()``,
    ``nonzero``, one-argument ``torch.where``, mask indexing, ``unique``, unsized ``repeat_interleave``..."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: dict[tuple[str, str], int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            key = (str(func.overloadpacket), _call_site())
            self.sites[key] = self.sites.get(key, 0) + 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def table(self) -> str:
        """One line a call site, most frequent first."""
        rows = sorted(self.sites.items(), key=lambda item: -item[1])
        return "\n".join(f"{count:6d}  {op:32s} {site}" for (op, site), count in rows)

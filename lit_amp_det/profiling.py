"""How lit_amp_det measures: peak memory, bytes saved for backward, step time and images per batch.

The callbacks (``MemoryMonitor``, ``Throughput``, ``RunStats``), the benches and the tasks all measure through
this one module, so a figure means the same thing wherever it is printed. It imports only the standard library,
torch and :mod:`lit_amp_det.cpu_heap` (glibc's heap settings, which the measurements pin), so any layer may use it.
"""

from __future__ import annotations

import contextlib
import re
import resource
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

# the glibc heap controls the measurements use, re-exported for the callers that measure
from lit_amp_det.cpu_heap import pin_malloc_threshold, release_freed_cpu_memory, unpin_malloc_threshold

__all__ = [
    "MB",
    "MemoryProbe",
    "SavedTensorBytes",
    "StepTimer",
    "count_images",
    "minor_page_faults",
    "pin_malloc_threshold",
    "resident_bytes",
    "release_freed_cpu_memory",
    "synchronize",
    "timed",
    "unpin_malloc_threshold",
]

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


def resident_bytes() -> int | None:
    """The process's resident set now (``VmRSS``), or None where ``/proc`` has none."""
    kib = _proc_status_kib("VmRSS")
    return None if kib is None else 1024 * kib


def _reset_cpu_high_water_mark() -> bool:
    """Resets the process's peak resident set (``VmHWM``) to its current size; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def minor_page_faults() -> int:
    """Minor page faults this process has taken so far (``ru_minflt``): pages the kernel mapped in on first touch,
    e.g. every page of a large block glibc got fresh from the OS (:mod:`lit_amp_det.cpu_heap`)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# --------------------------------------------------------------------------------------------- the probe

class MemoryProbe:
    """Peak and in-use memory of one device: the CUDA caching allocator, or this process on a CPU.

    On a CPU the peak is the process's high-water mark (``VmHWM``, reset by writing ``5`` to
    ``/proc/self/clear_refs``); where that is not allowed, ``ru_maxrss``, which only ever grows. ``source``
    names what is measured; ``resettable`` is False in that last case, where :meth:`peak_bytes` is the peak
    since the process started.
    """

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

def _is_parameter_cast(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a dtype copy of a trainable parameter (autocast's low-precision weight copies)."""
    fn = tensor.grad_fn
    return fn is not None and fn.name() == "ToCopyBackward0" and any(
        isinstance(getattr(next_fn, "variable", None), nn.Parameter) for next_fn, _ in fn.next_functions)


class SavedTensorBytes:
    """Counts the bytes autograd saves for backward while the context is open.

    Each distinct storage is counted once, whole (a saved view keeps all of its storage alive); storages of
    ``exclude`` (the model's parameters and buffers, which are resident anyway) are not counted. Of the total,
    ``weight_cast_bytes`` are dtype copies of trainable parameters: under autocast every conv and linear keeps
    a low-precision copy of its weight, which on small inputs can outweigh the activations it halves; and
    ``within_bytes`` are storages first saved while the forward of the module ``within`` ran (e.g. a
    backbone). Tensors are saved unchanged, so this only observes. Device independent: it counts tensors, not
    allocator blocks.
    """

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
                if _is_parameter_cast(tensor):
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
    steps are not timed (allocator growth, autotuning, lazy optimizer state). ``clock`` is swappable for tests.
    """

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
    raise TypeError(
        f"Throughput counts images in (images, targets) batches, but the training batch is a {kind}{length}; "
        "pass Throughput(batch_size_fn=...) returning the number of images of your batches"
    )

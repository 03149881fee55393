"""How lit_amp_det measures: peak memory, bytes saved for backward, step time and images per batch.

The callbacks (``MemoryMonitor``, ``Throughput``, ``RunStats``), the benches and the tasks all measure through
this one module, so a figure means the same thing wherever it is printed. It imports only the standard library
and torch, so any layer may use it.
"""

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
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "MB",
    "SYNC_KINDS",
    "HostSyncs",
    "MemoryProbe",
    "SavedTensorBytes",
    "StepTimer",
    "count_images",
    "pin_malloc_threshold",
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
    """Returns freed heap to the OS, so a resident-set peak measures this step, not the last one's
    leftovers.
    """
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None)  # glibc; musl has none
    if trim is not None:
        trim(0)


def pin_malloc_threshold(threshold: int = 128 * 1024) -> None:
    """Makes glibc hand large frees back to the OS (otherwise its mmap threshold grows and the resident set
    stays up), so that consecutive peaks are comparable. Costs page faults: :func:`unpin_malloc_threshold`
    afterwards.
    """
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

    On a CPU the peak is the process's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``);
    where that is not allowed, ``ru_maxrss``, which only grows (``resettable`` False). ``source`` names what
    is measured.
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
        """What a later peak is measured above: in use now, or the peak so far where the peak cannot be
        reset.
        """
        in_use = self.in_use_bytes()
        return in_use if self.resettable and in_use is not None else self.peak_bytes()


# ------------------------------------------------------------------------------------ saved for backward
def _is_parameter_cast(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a dtype copy of a trainable parameter: one of autocast's low-precision weight
    copies, which it makes afresh each forward and autograd saves alongside the activations.

    Such a copy is the output of a ``to`` (``ToCopyBackward0``) whose input is an ``nn.Parameter``'s gradient
    accumulator; a copy of a frozen parameter or of a buffer has no gradient edge, so it is not one.
    """
    fn = tensor.grad_fn
    return (
        fn is not None
        and fn.name() == "ToCopyBackward0"
        and any(
            isinstance(getattr(next_fn, "variable", None), nn.Parameter) for next_fn, _ in fn.next_functions
        )
    )


class SavedTensorBytes:
    """Counts the bytes autograd saves for backward while the context is open.

    Each distinct storage is counted once, whole (a saved view keeps all of it alive); storages of ``exclude``
    (the parameters and buffers, resident anyway) are not counted. Of the total, ``weight_cast_bytes`` are
    dtype copies of trainable parameters (autocast's low-precision weight copies), and ``within_bytes`` are
    storages first saved during the forward of the module ``within``. It only observes, and counts tensors,
    not allocator blocks.
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
    steps are not timed (allocator growth, autotuning, lazy optimizer state). ``clock`` is swappable for
    tests.
    """

    def __init__(
        self, device: torch.device | str, warmup: int = 0, clock: Callable[[], float] = time.perf_counter
    ) -> None:
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
    """Images in a detection batch ``(images, targets)``: ``[3, H, W]`` tensors in a sequence, or ``[N, 3, H,
    W]``.
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        images = batch[0]
        if isinstance(images, torch.Tensor) and images.dim() == 4:
            return int(images.shape[0])
        if isinstance(images, Sequence) and not isinstance(images, (str, bytes)):
            return len(images)
    kind = type(batch).__name__
    length = f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""
    raise TypeError(
        f"Throughput counts images in (images, targets) batches, but the training batch is a "
        f"{kind}{length}; pass Throughput(batch_size_fn=...) returning the number of images of your "
        "batches"
    )


# ------------------------------------------------------------------------------------- host synchronisations
_aten = torch.ops.aten
#: ops that read a tensor's values on the host, or size their output by them: on a GPU each waits for the
#: queued kernels (and breaks a ``torch.compile`` graph, and forbids CUDA-graph capture); mask indexing is a
#: nonzero inside
_VALUE_READS = {
    _aten._local_scalar_dense.default,
    _aten.is_nonzero.default,
    _aten.equal.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_consecutive.default,
    _aten.unique_dim.default,
    _aten.repeat_interleave.Tensor,
    _aten.item.default,
    _aten.where.default,  # whole under inference_mode
    _aten.nonzero_numpy.default,
}
#: ops whose CUDA kernels read values back to size or bound their work (a wait inside the kernel's launch)
_READ_BACK_KERNELS = {
    _aten.bincount.default,
    _aten.histc.default,
    _aten.multinomial.default,
}
_INDEXING = {
    _aten.index.Tensor,
    _aten.index_put.default,
    _aten.index_put_.default,
    _aten._index_put_impl_.default,
}
#: ops that make a tensor from host data (``torch.tensor``, ``torch.as_tensor`` of Python numbers)
_HOST_DATA = {_aten.lift_fresh.default, _aten.lift_fresh_copy.default}
#: Tensor methods that hand a device tensor's values to the host (``item`` and ``bool`` reach the dispatcher
#: as ``_local_scalar_dense``; these may not, and on a CPU tensor nothing reaches it at all)
_HOST_READ_METHODS = {"tolist": "Tensor.tolist", "numpy": "Tensor.numpy", "cpu": "Tensor.cpu"}
_TORCH_DIR = str(Path(torch.__file__).parent) + "/"

#: what :class:`HostSyncs` counts, by kind
SYNC_KINDS = (
    "value read",
    "read-back kernel",
    "device copy",
    "host data on a device",
    "host read",
    "explicit sync",
)


def _is_device(device: torch.device | str | None) -> bool:
    """Whether ``device`` is an accelerator (anything but the CPU and the meta device)."""
    return device is not None and torch.device(device).type not in ("cpu", "meta")


def _copy_direction(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """``"cpu->cuda"`` (say) for an ``aten`` copy between the host and a device, None for any other call."""
    if func is _aten._to_copy.default:
        source = args[0]
        target = kwargs.get("device")
    elif func is _aten.copy_.default:
        source = args[1]
        target = args[0].device
    else:
        return None
    if not isinstance(source, Tensor) or target is None:
        return None
    source_device = source.device
    target_device = torch.device(target)
    if _is_device(source_device) == _is_device(target_device):
        return None
    return f"{source_device.type}->{target_device.type}"


def _value_read(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    if func in _VALUE_READS:
        return func is not _aten.repeat_interleave.Tensor or kwargs.get("output_size") is None
    if func in _INDEXING:
        return any(isinstance(i, Tensor) and i.dtype == torch.bool for i in args[1] or ())
    return False


def _call_site() -> str:
    """``path:line`` of the innermost frame outside torch and this module: the code that asked for the
    value.
    """
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"


class _MethodReads(torch.overrides.TorchFunctionMode):
    """Counts the Tensor methods that hand values to the host (``tolist``, ``numpy``, ``cpu``).

    ``to(device)`` is left to the copy count: in a step it usually names the step's own device, which on a CPU
    run is the host.
    """

    def __init__(self, counter: HostSyncs) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # by name: torch hands the mode the class's attribute of that name, a wrapper if one was installed
        name = _HOST_READ_METHODS.get(getattr(func, "__name__", ""))
        if name is None:
            return func(*args, **kwargs)
        self.counter.add("host read", name)
        with self.counter.quiet():  # the copy it makes is this read, not a second wait
            return func(*args, **kwargs)


class _DispatchCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten calls that wait for a device: value reads, read-back kernels, copies, host data.

    ``torch.tensor(numbers, device=cuda)`` is one wait, counted as host data on a device: a fake tensor mode
    makes it as ``lift_fresh`` on the host then a copy, CUDA as a copy then ``lift_fresh`` on the device;
    either way the copy is not counted again.
    """

    def __init__(self, counter: HostSyncs) -> None:
        super().__init__()
        self.counter = counter
        self._lifted_on_host = WeakIdKeyDictionary()  # host tensors made from numbers, not yet on a device
        self._copied: WeakIdKeyDictionary = (
            WeakIdKeyDictionary()
        )  # a device copy's result -> its (what, site)

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        op = str(func.overloadpacket)
        copied = None
        if _value_read(func, args, kwargs):
            self.counter.add("value read", op)
        elif func in _READ_BACK_KERNELS:
            self.counter.add("read-back kernel", op)
        else:
            direction = _copy_direction(func, args, kwargs)
            if direction is not None and func is _aten._to_copy.default and args[0] in self._lifted_on_host:
                target = direction.split("->")[1]
                self.counter.add("host data on a device", f"aten.lift_fresh ({target})")
            elif direction is not None:
                copied = self.counter.add("device copy", f"{op} {direction}")
        result = func(*args, **kwargs)
        if copied is not None and isinstance(result, Tensor):
            self._copied[result] = copied
        if func in _HOST_DATA and isinstance(result, Tensor):
            if not _is_device(result.device):
                self._lifted_on_host[result] = True
            elif result in self._copied or args[0] in self._copied:
                source = self._copied.get(result) or self._copied[args[0]]
                what = f"aten.lift_fresh ({result.device.type})"
                self.counter.reclassify(source, "device copy", "host data on a device", what)
            else:
                self.counter.add("host data on a device", f"{op} ({result.device.type})")
        return result


def _explicit_syncs() -> list[tuple[Any, str, str]]:
    """(owner, attribute, name) of the functions that block the host until a device is done."""
    syncs = [(torch.cuda, "synchronize", "torch.cuda.synchronize")]
    syncs.append((torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize"))
    syncs.append((torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize"))
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "synchronize"):
        syncs.append((accelerator, "synchronize", "torch.accelerator.synchronize"))
    return syncs


class HostSyncs:
    """Counts, while active, what makes the host wait for a device, by (what, call site).

    A step that waits nowhere can run ahead of the GPU and be captured in a CUDA graph. Counted, by kind
    (:data:`SYNC_KINDS`):

    * value reads: ``.item()``, ``bool()``, ``nonzero``, one-argument ``torch.where``, mask indexing,
      ``unique``, unsized ``repeat_interleave``; CPU tensors dispatch them as CUDA ones do, so a CPU run shows
      where a GPU step would stop;
    * read-back kernels: ops whose CUDA kernels read values back (``bincount``, ``histc``, ``multinomial``);
    * device copies between the host and a device (a pageable copy blocks the host; under capture it is an
      error);
    * host data on a device: tensors built from Python numbers on a device (``torch.tensor(...,
      device=cuda)``);
    * host reads: ``tolist``, ``numpy``, ``cpu``, counted on any tensor, since in a step on a GPU the tensor
      would be on the device (``to("cpu")`` of a device tensor counts as a device copy);
    * explicit syncs: ``torch.cuda.synchronize`` and the stream, event and accelerator ``synchronize``.

    Copies and host data show only where tensors are on a device: run the step on CUDA, or on fake CUDA
    tensors (``FakeTensorMode``) with this counter entered inside the fake mode.
    """

    def __init__(self) -> None:
        self.sites: dict[tuple[str, str], int] = {}
        self.kinds: dict[str, int] = dict.fromkeys(SYNC_KINDS, 0)
        self._quiet = 0
        self._stack = contextlib.ExitStack()

    def add(self, kind: str, what: str) -> tuple[str, str] | None:
        """Counts one wait of ``kind`` (one of :data:`SYNC_KINDS`) for ``what`` at the caller's call site;
        returns the site's key, or None when counting is quiet.
        """
        if self._quiet:
            return None
        key = (what, _call_site())
        self.sites[key] = self.sites.get(key, 0) + 1
        self.kinds[kind] += 1
        return key

    def reclassify(self, key: tuple[str, str], kind: str, new_kind: str, what: str) -> None:
        """Moves one wait counted at ``key`` from ``kind`` to ``new_kind``, named ``what`` (a copy found to be
        part of a host-data tensor, say).
        """
        self.sites[key] -= 1
        if not self.sites[key]:
            del self.sites[key]
        new_key = (what, key[1])
        self.sites[new_key] = self.sites.get(new_key, 0) + 1
        self.kinds[kind] -= 1
        self.kinds[new_kind] += 1

    @contextlib.contextmanager
    def quiet(self) -> Any:
        """Counts nothing inside (the parts of a wait already counted)."""
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def _counting(self, function: Callable[..., Any], name: str) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.add("explicit sync", name)
            with self.quiet():
                return function(*args, **kwargs)

        return counted

    def __enter__(self) -> HostSyncs:
        for owner, attribute, name in _explicit_syncs():
            original = owner.__dict__[attribute] if isinstance(owner, type) else getattr(owner, attribute)
            self._stack.callback(setattr, owner, attribute, original)
            setattr(owner, attribute, self._counting(getattr(owner, attribute), name))
        self._stack.enter_context(_MethodReads(self))
        self._stack.enter_context(_DispatchCounter(self))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def table(self) -> str:
        """One line a call site, most frequent first."""
        rows = sorted(self.sites.items(), key=lambda item: -item[1])
        return "\n".join(f"{count:6d}  {op:32s} {site}" for (op, site), count in rows)

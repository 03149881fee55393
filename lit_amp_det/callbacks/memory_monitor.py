"""Logs peak memory per training step and epoch, and measures what each memory optimisation of the run saves.

Per step, :class:`MemoryMonitor` resets the peak at ``on_train_batch_start`` and reads it at ``on_train_batch_end``:
on a GPU the caching allocator's peak (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``), on a CPU
the process's high-water mark (``VmHWM`` from ``/proc/self/status``, reset by writing ``5`` to
``/proc/self/clear_refs``; where that is not allowed, ``ru_maxrss``, which only ever grows).

With ``compare_baseline=True`` it also answers "what do mixed precision and conv-bn eval buy on *this* model
and data?". Just before the first training step (after every ``on_train_epoch_start`` hook, so norms are in
the train/eval mode training uses) it runs forward and backward, no optimizer step, on deep copies of
``pl_module.model`` -- the real model, its optimizer and its BatchNorm statistics are never touched, and the
random-number generators are restored afterwards -- over the first training batches (drawn at
``on_train_start`` from a copy of the batch sampler, so the data order and the resumable sampler state are
unchanged). Rows are cumulative: a baseline with every optimisation off (fp32, conv-bn eval disabled), then
the trainer's mixed precision, then conv-bn eval, each only if this run uses it. Each row reports the peak
memory, the memory a step adds on top of what was resident when it started, the bytes autograd saves for
backward (device independent, counted with ``torch.autograd.graph.saved_tensors_hooks``) and the median step
time. At the end of fit the rows and the peak observed during training are printed as a markdown table and
written to ``memory_savings.md`` / ``.json`` in the log directory.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import gc
import json
import random
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import move_data_to_device, rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lit_amp_det.callbacks.throughput import count_images

__all__ = ["MemoryMonitor", "MemoryProbe", "SavedTensorBytes", "SavingsRow", "format_savings_table"]

_FIELD = "callbacks.memory_monitor"
_MB = 2**20
#: What the baseline copies need from the LightningModule (MaskRCNNModule has them all).
_MODULE_API = ("prepare_images", "training_targets", "compute_loss")
#: Precision strings that are not an optimisation to compare against the fp32 baseline.
_FULL_PRECISIONS = ("32-true", "32", "64-true", "64")


# --------------------------------------------------------------------------------------- memory probes


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


def _release_freed_cpu_memory() -> None:
    """Returns freed heap to the OS, so a resident-set peak measures this step, not the last one's leftovers."""
    gc.collect()
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _load_malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc; musl has none
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()


class MemoryProbe:
    """Peak and in-use memory of one device: the CUDA caching allocator, or this process on a CPU.

    ``source`` names what is measured; ``resettable`` is False where a CPU peak cannot be reset (no
    ``/proc/self/clear_refs``), in which case :meth:`peak_bytes` is the peak since the process started.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.source, self.resettable = "CUDA allocator (max_memory_allocated)", True
        elif _proc_status_kib("VmHWM") is not None and _reset_cpu_high_water_mark():
            self.source, self.resettable = "process VmHWM (reset per step via /proc/self/clear_refs)", True
        else:
            self.source, self.resettable = "process ru_maxrss (peak since start: not resettable here)", False

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

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


# ------------------------------------------------------------------------------- saved for backward


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
    a low-precision copy of its weight, which on small inputs can outweigh the activations it halves. Tensors
    are saved unchanged, so this only observes. Device independent: it counts tensors, not allocator blocks.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: set[int] = set()
        self.bytes = 0
        self.weight_cast_bytes = 0
        self._hooks: contextlib.AbstractContextManager[Any] | None = None

    def _pack(self, tensor: Tensor) -> Tensor:
        if tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            pointer = storage.data_ptr()
            if pointer and pointer not in self._exclude and pointer not in self._seen:
                self._seen.add(pointer)
                self.bytes += storage.nbytes()
                if _is_parameter_cast(tensor):
                    self.weight_cast_bytes += storage.nbytes()
        return tensor

    def __enter__(self) -> SavedTensorBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None


# ------------------------------------------------------------------------------------- the comparison


@dataclasses.dataclass
class SavingsRow:
    """One measured configuration: what was on, and its memory and time per forward+backward step."""

    label: str
    optimisations: list[str]
    peak_mb: float  # peak during the step (allocator peak, or process high-water mark)
    step_mb: float  # peak minus what was in use when the step started
    saved_for_backward_mb: float
    weight_casts_mb: float  # the part of saved_for_backward_mb that is low-precision copies of weights
    step_ms: float  # median over the measured steps


@contextlib.contextmanager
def _rng_preserved(device: torch.device) -> Iterator[None]:
    """Restores the torch (CPU and this GPU), NumPy and Python generators: samplers and RPN draw from them."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _conv_bn_eval_api() -> tuple[Callable[[nn.Module], bool], Callable[[nn.Module], Any]] | None:
    """``(conv_bn_eval_enabled, disable_conv_bn_eval)`` from :mod:`lit_amp_det.models.conv_bn`, if present."""
    try:
        from lit_amp_det.models.conv_bn import conv_bn_eval_enabled, disable_conv_bn_eval
    except ImportError:
        return None
    return conv_bn_eval_enabled, disable_conv_bn_eval


def _slug(label: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", label.lower()).strip("_")


def _ratio(value: float, base: float) -> float | None:
    """``value / base``; None where the baseline is 0 (e.g. a step that needed no new CPU pages)."""
    return value / base if base > 0 else None


class MemoryMonitor(Callback):
    """Logs peak memory per training step and epoch; optionally measures savings against an unoptimised baseline.

    Logged every training step: ``memory/step_peak_mb`` (peak during the step), ``memory/in_use_mb`` (allocated
    on the GPU, resident set on a CPU, at the end of the step) and, on a GPU, ``memory/step_peak_reserved_mb``.
    Every epoch: ``memory/epoch_peak_mb`` (and ``memory/epoch_peak_reserved_mb`` on a GPU).

    With ``compare_baseline``, once per fit (logged with the first epoch): for each measured row ``<row>`` in
    ``baseline``, ``bf16_mixed`` / ``16_mixed``, ``conv_bn_eval`` and ``current`` (the configuration of this
    run), ``memory/<row>_peak_mb``, ``memory/<row>_step_mb``, ``memory/<row>_saved_for_backward_mb``,
    ``memory/<row>_weight_casts_mb`` and ``memory/<row>_step_ms``; and current over baseline as
    ``memory/peak_ratio``, ``memory/step_memory_ratio``, ``memory/saved_for_backward_ratio`` and
    ``memory/step_time_ratio``. At the end of fit the savings table is printed and written to
    ``<trainer.log_dir>/memory_savings.md`` and ``.json``.

    Args:
        compare_baseline: measure the baseline and per-optimisation rows (costs ``(warmup_steps +
            baseline_steps)`` forward+backward passes per row, and one extra copy of the model while it runs).
        baseline_steps: measured steps per row, on as many distinct training batches where the loader has them.
        warmup_steps: unmeasured steps per row before those (lazy initialisation, autotuning).
    """

    def __init__(self, compare_baseline: bool = False, baseline_steps: int = 3, warmup_steps: int = 3) -> None:
        self.compare_baseline = compare_baseline
        self.baseline_steps = baseline_steps
        self.warmup_steps = warmup_steps
        self.rows: list[SavingsRow] = []
        self._probe: MemoryProbe | None = None
        self._batches: list[Any] | None = None
        self._pending_comparison = False
        self._started: float | None = None
        self._reset_epoch()
        self._step_peaks: list[float] = []
        self._step_ms: list[float] = []
        self._images_per_batch: list[int] = []

    def _reset_epoch(self) -> None:
        self._epoch_peak_mb = 0.0
        self._epoch_peak_reserved_mb = 0.0
        self._epoch_steps = 0

    # ---------------------------------------------------------------------------------- checks
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(self.compare_baseline, bool):
            raise ValueError(f"{_FIELD}.compare_baseline={self.compare_baseline!r} must be true or false")
        for name, low in (("baseline_steps", 1), ("warmup_steps", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{_FIELD}.{name}={value!r} must be an integer >= {low}")
        if stage != "fit" or not self.compare_baseline:
            return
        model = getattr(pl_module, "model", None)
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"{_FIELD}.compare_baseline=true measures deep copies of `pl_module.model`, but "
                f"{type(pl_module).__name__}.model is {type(model).__name__}; use a MaskRCNNModule (sub)class or set "
                f"{_FIELD}.compare_baseline=false"
            )
        missing = [name for name in _MODULE_API if not callable(getattr(pl_module, name, None))]
        if missing:
            raise ValueError(
                f"{_FIELD}.compare_baseline=true runs steps as MaskRCNNModule.training_step does, but "
                f"{type(pl_module).__name__} has no {missing}; use a MaskRCNNModule (sub)class or set "
                f"{_FIELD}.compare_baseline=false"
            )
        precision = str(trainer.precision_plugin.precision)
        if precision.endswith("-true") and precision not in _FULL_PRECISIONS:
            raise ValueError(
                f"{_FIELD}.compare_baseline=true compares against fp32, but trainer.precision={precision} stores the "
                "parameters in low precision; use 32-true, 16-mixed or bf16-mixed, or set compare_baseline=false"
            )

    # ----------------------------------------------------------------------------------- fit start
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._probe = MemoryProbe(pl_module.device)
        if not self._probe.resettable:
            rank_zero_warn(f"MemoryMonitor: {self._probe.source}; per-step CPU peaks are peaks since start")
        self._step_peaks, self._step_ms, self._images_per_batch = [], [], []
        self.rows = []
        self._pending_comparison = self.compare_baseline
        if self.compare_baseline:
            with _rng_preserved(pl_module.device):
                self._batches = self._draw_batches(trainer)

    def _draw_batches(self, trainer: pl.Trainer) -> list[Any] | None:
        """The first ``baseline_steps`` batches of a copy of the loader's batch sampler (None: not possible).

        The loader itself is not iterated: that would start its workers and, with a resumable sampler, consume
        its resume position. With samplers seeded per epoch (:class:`~lit_amp_det.data.sampler.
        ResumableBatchSampler`) these are exactly the first training batches; a plain shuffling ``DataLoader``
        draws its order from a generator it also uses for worker seeds, so there they are an equally random
        draw. Map-style datasets with a batch sampler only; otherwise the first real batch is used.
        """
        loader = trainer.train_dataloader
        if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
            return None
        if loader.batch_sampler is None:
            return None
        try:
            batch_sampler = copy.deepcopy(loader.batch_sampler)
        except (TypeError, copy.Error) as error:  # e.g. a sampler holding a lock or an open file
            rank_zero_warn(f"MemoryMonitor: cannot copy the batch sampler ({error}); measuring on the first batch")
            return None
        batches = []
        for keys in batch_sampler:
            batches.append(loader.collate_fn([loader.dataset[key] for key in keys]))
            if len(batches) == self.baseline_steps:
                break
        return batches or None

    # ----------------------------------------------------------------------------------- per step
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        assert self._probe is not None
        if self._pending_comparison:
            self._pending_comparison = False
            self._compare(trainer, pl_module, batch)
        if self._probe.cuda:
            torch.cuda.synchronize(self._probe.device)
        self._probe.reset_peak()
        self._started = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        probe = self._probe
        assert probe is not None and self._started is not None
        probe.synchronize()
        self._step_ms.append(1000.0 * (time.perf_counter() - self._started))
        in_use = probe.in_use_bytes()  # before the peak: the peak read then covers it
        peak_mb = probe.peak_bytes() / _MB
        self._step_peaks.append(peak_mb)
        self._epoch_peak_mb = max(self._epoch_peak_mb, peak_mb)
        self._epoch_steps += 1
        pl_module.log("memory/step_peak_mb", peak_mb, on_step=True, on_epoch=False, batch_size=1)
        if in_use is not None:
            pl_module.log("memory/in_use_mb", in_use / _MB, on_step=True, on_epoch=False, batch_size=1)
        reserved = probe.peak_reserved_bytes()
        if reserved is not None:
            self._epoch_peak_reserved_mb = max(self._epoch_peak_reserved_mb, reserved / _MB)
            pl_module.log("memory/step_peak_reserved_mb", reserved / _MB, on_step=True, on_epoch=False, batch_size=1)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_epoch()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._epoch_steps:
            return
        pl_module.log("memory/epoch_peak_mb", self._epoch_peak_mb, on_step=False, on_epoch=True, batch_size=1)
        if self._probe is not None and self._probe.cuda:
            pl_module.log("memory/epoch_peak_reserved_mb", self._epoch_peak_reserved_mb, on_step=False,
                          on_epoch=True, batch_size=1)

    # ------------------------------------------------------------------------------ the comparison
    def _plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[tuple[str, list[str], bool, bool]]:
        """Rows as ``(label, optimisations on, use the precision context, disable conv-bn eval)``, cumulative."""
        api = _conv_bn_eval_api()
        conv_bn = api is not None and bool(api[0](pl_module.model))
        precision = str(trainer.precision_plugin.precision)
        mixed = precision not in _FULL_PRECISIONS
        rows = [("baseline", [], False, conv_bn)]
        on: list[str] = []
        if mixed:
            on = [*on, precision]
            rows.append((precision, on, True, conv_bn))
        if conv_bn:
            on = [*on, "conv-bn eval"]
            rows.append(("conv-bn eval", on, mixed, False))
        return rows

    def _compare(self, trainer: pl.Trainer, pl_module: pl.LightningModule, first_batch: Any) -> None:
        """Measures every row of :meth:`_plan` on deep copies of ``pl_module.model`` and logs the numbers."""
        device = pl_module.device
        batches = self._batches or [first_batch]  # the first real batch where the loader could not be sampled
        batches = [move_data_to_device(b, device) for b in batches]
        self._batches = None
        with _rng_preserved(device), torch.enable_grad():
            for label, on, autocast, conv_bn_off in self._plan(trainer, pl_module):
                self.rows.append(self._measure(label, on, trainer, pl_module, batches, autocast, conv_bn_off))
        del batches
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the copies' blocks: give them back before training allocates
        self._log_rows(pl_module)

    def _measure(self, label: str, on: list[str], trainer: pl.Trainer, pl_module: pl.LightningModule,
                 batches: list[Any], autocast: bool, conv_bn_off: bool) -> SavingsRow:
        probe = self._probe
        assert probe is not None
        model = copy.deepcopy(pl_module.model)
        if conv_bn_off:
            api = _conv_bn_eval_api()
            assert api is not None
            api[1](model)
        plugin = trainer.precision_plugin
        context = plugin.forward_context if autocast else contextlib.nullcontext
        scaler = getattr(plugin, "scaler", None)
        loss_scale = float(scaler.get_scale()) if autocast and scaler is not None else 1.0  # fp16: as trained
        state = [*model.parameters(), *model.buffers()]
        peaks, steps, saved, casts, times = [], [], [], [], []
        in_use, started = 0, 0.0
        for index in range(self.warmup_steps + self.baseline_steps):
            images, targets = batches[index % len(batches)]
            for parameter in model.parameters():
                parameter.grad = None  # as zero_grad(set_to_none=True) before each training step
            measured = index >= self.warmup_steps
            if measured:
                if probe.cuda:
                    gc.collect()
                else:
                    _release_freed_cpu_memory()
                probe.synchronize()
                probe.reset_peak()
                in_use = probe.in_use_bytes() or 0
                started = time.perf_counter()
            with SavedTensorBytes(exclude=state) as counter:
                with context():
                    losses = model(pl_module.prepare_images(images), pl_module.training_targets(targets))
                    loss = pl_module.compute_loss(losses)
                (loss * loss_scale).backward()
            del losses, loss
            if measured:
                probe.synchronize()
                times.append(1000.0 * (time.perf_counter() - started))
                peak = probe.peak_bytes()
                peaks.append(peak / _MB)
                steps.append(max(peak - in_use, 0) / _MB)
                saved.append(counter.bytes / _MB)
                casts.append(counter.weight_cast_bytes / _MB)
                self._images_per_batch.append(count_images((images, targets)))
        del model, state
        return SavingsRow(label=label, optimisations=on, peak_mb=max(peaks), step_mb=max(steps),
                          saved_for_backward_mb=max(saved), weight_casts_mb=max(casts),
                          step_ms=statistics.median(times))

    def _log_rows(self, pl_module: pl.LightningModule) -> None:
        base, current = self.rows[0], self.rows[-1]
        named = {_slug(row.label): row for row in self.rows[1:]}
        for name, row in {"baseline": base, **named, "current": current}.items():
            for field in ("peak_mb", "step_mb", "saved_for_backward_mb", "weight_casts_mb", "step_ms"):
                pl_module.log(f"memory/{name}_{field}", float(getattr(row, field)), on_step=False, on_epoch=True,
                              batch_size=1)
        ratios = {
            "peak_ratio": _ratio(current.peak_mb, base.peak_mb),
            "step_memory_ratio": _ratio(current.step_mb, base.step_mb),
            "saved_for_backward_ratio": _ratio(current.saved_for_backward_mb, base.saved_for_backward_mb),
            "step_time_ratio": _ratio(current.step_ms, base.step_ms),
        }
        for name, value in ratios.items():
            if value is not None:
                pl_module.log(f"memory/{name}", value, on_step=False, on_epoch=True, batch_size=1)

    # ---------------------------------------------------------------------------------- the report
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.compare_baseline:
            return
        if not self.rows:
            rank_zero_warn("MemoryMonitor(compare_baseline=True) wrote no savings table: no training step ran")
            return
        # on every rank: Trainer.log_dir broadcasts, which must not happen inside rank_zero_only
        self._write_report(trainer, pl_module, Path(trainer.log_dir or trainer.default_root_dir))

    def report(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The savings table's data: the measured rows, ratios to the baseline and what training observed."""
        assert self._probe is not None
        base = self.rows[0]
        timed = self._step_ms[self.warmup_steps:] or self._step_ms
        training = {
            "steps": len(self._step_peaks),
            "peak_mb": max(self._step_peaks) if self._step_peaks else None,
            "step_ms_median": statistics.median(timed) if timed else None,
        }
        rows = []
        for row in self.rows:
            entry = dataclasses.asdict(row)
            entry.update({
                "peak_vs_baseline": _ratio(row.peak_mb, base.peak_mb),
                "step_mb_vs_baseline": _ratio(row.step_mb, base.step_mb),
                "saved_for_backward_vs_baseline": _ratio(row.saved_for_backward_mb, base.saved_for_backward_mb),
                "step_ms_vs_baseline": _ratio(row.step_ms, base.step_ms),
            })
            rows.append(entry)
        return {
            "device": str(pl_module.device),
            "precision": str(trainer.precision_plugin.precision),
            "memory_source": self._probe.source,
            "model": type(pl_module.model).__name__,
            "images_per_batch": sorted(set(self._images_per_batch)),
            "warmup_steps": self.warmup_steps,
            "measured_steps": self.baseline_steps,
            "torch": torch.__version__,
            "rows": rows,
            "current": rows[-1]["label"],
            "training": training,
        }

    @rank_zero_only
    def _write_report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Path) -> None:
        data = self.report(trainer, pl_module)
        table = format_savings_table(data)
        print(table, flush=True)
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory_savings.md").write_text(table + "\n")
        (out / "memory_savings.json").write_text(json.dumps(data, indent=2) + "\n")
        print(f"memory savings table: {out / 'memory_savings.md'}", flush=True)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(compare_baseline={self.compare_baseline}, "
                f"baseline_steps={self.baseline_steps}, warmup_steps={self.warmup_steps})")


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def format_savings_table(data: dict[str, Any]) -> str:
    """The markdown savings table of :meth:`MemoryMonitor.report` data."""
    rows, training = data["rows"], data["training"]
    base = rows[0]
    lines = [
        "## Memory savings",
        "",
        f"device={data['device']} precision={data['precision']} model={data['model']} "
        f"images/batch={','.join(map(str, data['images_per_batch']))} torch={data['torch']}; memory: "
        f"{data['memory_source']}",
        f"Rows: forward+backward (no optimizer step) on deep copies of the model, {data['measured_steps']} measured "
        f"steps after {data['warmup_steps']} warm-up; each row adds one optimisation to the row above.",
        "",
        "| configuration | peak MB | peak vs baseline | step MB | step MB vs baseline | saved for backward MB "
        "| saved vs baseline | of which weight casts MB | step ms | time vs baseline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for index, row in enumerate(rows):
        label = "baseline: fp32, conv-bn eval off" if index == 0 else f"+ {row['label']}"
        if index == len(rows) - 1:
            label += " (this run)"
        cells = [
            label,
            f"{row['peak_mb']:.1f}", _x(row["peak_vs_baseline"]),
            f"{row['step_mb']:.1f}", _x(row["step_mb_vs_baseline"]),
            f"{row['saved_for_backward_mb']:.1f}", _x(row["saved_for_backward_vs_baseline"]),
            f"{row['weight_casts_mb']:.1f}",
            f"{row['step_ms']:.1f}", _x(row["step_ms_vs_baseline"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if training["peak_mb"] is not None:
        step_ms = training["step_ms_median"]
        cells = [
            f"training, observed over {training['steps']} steps",
            f"{training['peak_mb']:.1f}", _x(_ratio(training["peak_mb"], base["peak_mb"])),
            "-", "-", "-", "-", "-",
            f"{step_ms:.1f}", _x(_ratio(step_ms, base["step_ms"])),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "peak MB: the highest memory during a step; step MB: that peak minus what was in use when the step "
        "started; saved for backward: tensors autograd keeps for backward (parameters and buffers excluded; "
        "weight casts: autocast's low-precision copies of trainable weights, included in it). "
        "The training row includes the optimizer step and its state; its time is the median after the "
        "warm-up steps.",
    ]
    return "\n".join(lines)

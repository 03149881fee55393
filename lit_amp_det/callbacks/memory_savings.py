"""What each memory optimisation of a fit saves, measured on copies of the model:
``MemoryMonitor(compare_baseline)``.

Rows are cumulative: a baseline with every optimisation off (fp32, conv-bn eval disabled), then the trainer's
precision, then conv-bn eval, each only if the run uses it. Each row runs forward and backward (no optimizer
step) on a deep copy of ``pl_module.model`` over the first training batches, so the real model, optimizer,
BatchNorm statistics, random generators and loader position are never touched. Driven by
:class:`~lit_amp_det.callbacks.memory_monitor.MemoryMonitor`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import json
import random
import re
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import move_data_to_device, rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lit_amp_det.models.conv_bn import conv_bn_eval_enabled, disable_conv_bn_eval
from lit_amp_det.precision.master_weights import full_precision_copy, holds_masters
from lit_amp_det.precision.plugin import loss_scaler
from lit_amp_det.profiling import (
    MB,
    MemoryProbe,
    SavedTensorBytes,
    count_images,
    release_freed_cpu_memory,
    timed,
)

__all__ = [
    "BaselineComparison",
    "SavingsRow",
    "check_comparable",
    "draw_batches",
    "format_savings_table",
    "write_savings",
]

#: What the baseline copies need from the LightningModule (MaskRCNNModule has them all).
_MODULE_API = ("prepare_images", "training_targets", "compute_loss")
#: Precision strings that are not an optimisation to compare against the fp32 baseline.
_FULL_PRECISIONS = ("32-true", "32", "64-true", "64")


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


def check_comparable(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Fails with the fix named where copies of ``pl_module.model`` cannot be measured against fp32."""
    fix = "use a MaskRCNNModule (sub)class or set compare_baseline=false"
    model = getattr(pl_module, "model", None)
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"MemoryMonitor(compare_baseline=True) measures deep copies of `pl_module.model`, but "
            f"{type(pl_module).__name__}.model is {type(model).__name__}; {fix}"
        )
    missing = [name for name in _MODULE_API if not callable(getattr(pl_module, name, None))]
    if missing:
        raise ValueError(
            f"MemoryMonitor(compare_baseline=True) runs steps as MaskRCNNModule.training_step does, but "
            f"{type(pl_module).__name__} has no {missing}; {fix}"
        )
    precision = str(trainer.precision_plugin.precision)
    if precision.endswith("-true") and precision not in _FULL_PRECISIONS:
        raise ValueError(
            f"MemoryMonitor(compare_baseline=True) compares against fp32, but trainer.precision="
            f"{precision} stores the parameters in low precision without fp32 copies to measure the "
            "baseline on; use 32-true, 16-mixed, bf16-mixed, 16-weights or bf16-weights, or set "
            "callbacks.memory_monitor.compare_baseline=false"
        )


@contextlib.contextmanager
def _rng_preserved(device: torch.device) -> Iterator[None]:
    """Restores the torch (CPU and this GPU), NumPy and Python generators: samplers and RPN draw from them."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = (
        [device.index if device.index is not None else torch.cuda.current_device()]
        if device.type == "cuda"
        else []
    )
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def draw_batches(loader: Any, count: int) -> list[Any] | None:
    """The first ``count`` batches of a copy of ``loader``'s batch sampler (None: not possible).

    The loader itself is not iterated: that would start its workers and consume a resumable sampler's
    position. With per-epoch seeded samplers these are exactly the first training batches, else an equally
    random draw. Map-style datasets with a batch sampler only; otherwise the caller uses the first real batch.
    """
    if (
        not isinstance(loader, DataLoader)
        or isinstance(loader.dataset, IterableDataset)
        or loader.batch_sampler is None
    ):
        return None
    try:
        batch_sampler = copy.deepcopy(loader.batch_sampler)
    except (TypeError, copy.Error) as error:  # e.g. a sampler holding a lock or an open file
        rank_zero_warn(
            f"MemoryMonitor: cannot copy the batch sampler ({error}); measuring on the first batch"
        )
        return None
    batches = []
    for keys in batch_sampler:
        batches.append(loader.collate_fn([loader.dataset[key] for key in keys]))
        if len(batches) == count:
            break
    return batches or None


def _ratio(value: float, base: float) -> float | None:
    """``value / base``; None where the baseline is 0 (e.g. a step that needed no new CPU pages)."""
    return value / base if base > 0 else None


#: SavingsRow fields compared with the baseline -> (the logged ratio's name, the report's key)
_RATIOS = {
    "peak_mb": ("peak_ratio", "peak_vs_baseline"),
    "step_mb": ("step_memory_ratio", "step_mb_vs_baseline"),
    "saved_for_backward_mb": ("saved_for_backward_ratio", "saved_for_backward_vs_baseline"),
    "step_ms": ("step_time_ratio", "step_ms_vs_baseline"),
}


def _forward_backward(
    model: nn.Module,
    pl_module: pl.LightningModule,
    batch: Any,
    context: Callable[[], Any],
    loss_scale: float,
    counter: SavedTensorBytes,
) -> None:
    """One step as ``MaskRCNNModule.training_step`` runs it, without the optimizer."""
    images, targets = batch
    with counter:
        with context():
            losses = model(pl_module.prepare_images(images), pl_module.training_targets(targets))
            loss = pl_module.compute_loss(losses)
        (loss * loss_scale).backward()


class BaselineComparison:
    """Measures the savings rows once per fit (see the module docstring); arguments as ``MemoryMonitor``'s."""

    def __init__(self, baseline_steps: int, warmup_steps: int) -> None:
        self.baseline_steps, self.warmup_steps = baseline_steps, warmup_steps
        self.rows: list[SavingsRow] = []
        self.images_per_batch: list[int] = []
        self._batches: list[Any] | None = None

    def prepare(self, trainer: pl.Trainer, device: torch.device) -> None:
        """Draws the batches at ``on_train_start``, before the loader is iterated."""
        with _rng_preserved(device):
            self._batches = draw_batches(trainer.train_dataloader, self.baseline_steps)

    def _plan(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> list[tuple[str, list[str], bool, bool]]:
        """Rows as ``(label, optimisations on, in the trainer's precision, disable conv-bn eval)``,
        cumulative; a row outside the trainer's precision runs in fp32 (on a full-precision copy for
        ``*-weights`` models).
        """
        conv_bn = bool(conv_bn_eval_enabled(pl_module.model))
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

    def run(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, first_batch: Any, probe: MemoryProbe
    ) -> None:
        """Measures every row of :meth:`_plan` on deep copies of ``pl_module.model`` and logs the numbers;
        called just before the first training step, so norms are in the train/eval mode training uses.
        """
        device = pl_module.device
        batches = self._batches or [first_batch]  # the first real batch where the loader could not be sampled
        batches = [move_data_to_device(b, device) for b in batches]
        self._batches = None
        with _rng_preserved(device), torch.enable_grad():
            for label, on, in_precision, conv_bn_off in self._plan(trainer, pl_module):
                self.rows.append(
                    self._measure(label, on, trainer, pl_module, batches, in_precision, conv_bn_off, probe)
                )
        del batches
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the copies' blocks: give them back before training allocates
        self._log_rows(pl_module)

    def _measure(
        self,
        label: str,
        on: list[str],
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batches: list[Any],
        in_precision: bool,
        conv_bn_off: bool,
        probe: MemoryProbe,
    ) -> SavingsRow:
        if in_precision or not holds_masters(pl_module.model):
            model = copy.deepcopy(pl_module.model)
        else:  # the fp32 baseline of a *-weights run: the masters as the weights
            model = full_precision_copy(pl_module.model)
        if conv_bn_off:
            disable_conv_bn_eval(model)
        plugin = trainer.precision_plugin
        context = plugin.forward_context if in_precision else contextlib.nullcontext
        scaler = loss_scaler(plugin)
        loss_scale = (
            float(scaler.get_scale()) if in_precision and scaler is not None else 1.0
        )  # fp16: as trained
        state = [*model.parameters(), *model.buffers()]
        peaks, steps, saved, casts, times = [], [], [], [], []
        for index in range(self.warmup_steps + self.baseline_steps):
            batch = batches[index % len(batches)]
            for parameter in model.parameters():
                parameter.grad = None  # as zero_grad(set_to_none=True) before each training step
            counter = SavedTensorBytes(exclude=state)
            step = functools.partial(_forward_backward, model, pl_module, batch, context, loss_scale, counter)
            if index < self.warmup_steps:
                step()
                continue
            (gc.collect if probe.cuda else release_freed_cpu_memory)()
            probe.synchronize()
            probe.reset_peak()
            in_use = probe.in_use_bytes() or 0
            times.append(1000.0 * timed(step, probe.device))
            peak = probe.peak_bytes()
            peaks.append(peak / MB)
            steps.append(max(peak - in_use, 0) / MB)
            saved.append(counter.bytes / MB)
            casts.append(counter.weight_cast_bytes / MB)
            self.images_per_batch.append(count_images(batch))
        del model, state
        return SavingsRow(
            label=label,
            optimisations=on,
            peak_mb=max(peaks),
            step_mb=max(steps),
            saved_for_backward_mb=max(saved),
            weight_casts_mb=max(casts),
            step_ms=statistics.median(times),
        )

    def _log_rows(self, pl_module: pl.LightningModule) -> None:
        base, current = self.rows[0], self.rows[-1]
        named = {re.sub(r"[^0-9a-z]+", "_", row.label.lower()).strip("_"): row for row in self.rows[1:]}
        for name, row in {"baseline": base, **named, "current": current}.items():
            for field in ("peak_mb", "step_mb", "saved_for_backward_mb", "weight_casts_mb", "step_ms"):
                pl_module.log(
                    f"memory/{name}_{field}",
                    float(getattr(row, field)),
                    on_step=False,
                    on_epoch=True,
                    batch_size=1,
                )
        for field, (name, _) in _RATIOS.items():
            value = _ratio(getattr(current, field), getattr(base, field))
            if value is not None:
                pl_module.log(f"memory/{name}", value, on_step=False, on_epoch=True, batch_size=1)

    def report(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, memory_source: str, training: dict[str, Any]
    ) -> dict[str, Any]:
        """The savings table's data: the measured rows, ratios to the baseline and ``training`` (observed)."""
        base = self.rows[0]
        rows = [
            {
                **dataclasses.asdict(row),
                **{
                    key: _ratio(getattr(row, field), getattr(base, field))
                    for field, (_, key) in _RATIOS.items()
                },
            }
            for row in self.rows
        ]
        return {
            "device": str(pl_module.device),
            "precision": str(trainer.precision_plugin.precision),
            "memory_source": memory_source,
            "model": type(pl_module.model).__name__,
            "images_per_batch": sorted(set(self.images_per_batch)),
            "warmup_steps": self.warmup_steps,
            "measured_steps": self.baseline_steps,
            "torch": torch.__version__,
            "rows": rows,
            "current": rows[-1]["label"],
            "training": training,
        }


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def format_savings_table(data: dict[str, Any]) -> str:
    """The markdown savings table of :meth:`BaselineComparison.report` data."""
    rows, training, base = data["rows"], data["training"], data["rows"][0]
    lines = [
        "## Memory savings",
        "",
        f"device={data['device']} precision={data['precision']} model={data['model']} images/batch="
        f"{','.join(map(str, data['images_per_batch']))} torch={data['torch']}; memory: "
        f"{data['memory_source']}",
        f"Rows: forward+backward (no optimizer step) on deep copies of the model, {data['measured_steps']} "
        f"measured steps after {data['warmup_steps']} warm-up; "
        "each row adds one optimisation to the row above.",
        "",
        "| configuration | peak MB | peak vs baseline | step MB | step MB vs baseline "
        "| saved for backward MB "
        "| saved vs baseline | of which weight casts MB | step ms | time vs baseline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for index, row in enumerate(rows):
        label = "baseline: fp32, conv-bn eval off" if index == 0 else f"+ {row['label']}"
        if index == len(rows) - 1:
            label += " (this run)"
        cells = [
            label,
            f"{row['peak_mb']:.1f}",
            _x(row["peak_vs_baseline"]),
            f"{row['step_mb']:.1f}",
            _x(row["step_mb_vs_baseline"]),
            f"{row['saved_for_backward_mb']:.1f}",
            _x(row["saved_for_backward_vs_baseline"]),
            f"{row['weight_casts_mb']:.1f}",
            f"{row['step_ms']:.1f}",
            _x(row["step_ms_vs_baseline"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    if training["peak_mb"] is not None:
        step_ms = training["step_ms_median"]
        cells = [
            f"training, observed over {training['steps']} steps",
            f"{training['peak_mb']:.1f}",
            _x(_ratio(training["peak_mb"], base["peak_mb"])),
            "-",
            "-",
            "-",
            "-",
            "-",
            f"{step_ms:.1f}",
            _x(_ratio(step_ms, base["step_ms"])),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "peak MB: the highest memory during a step; step MB: that peak minus what was in use when the step "
        "started; saved for backward: tensors autograd keeps for backward (parameters and buffers excluded; "
        "weight casts: autocast's low-precision copies of trainable weights, included in it). The training "
        "row includes the optimizer step and its state; its time is the median after the warm-up steps.",
    ]
    return "\n".join(lines)


def write_savings(data: dict[str, Any], out: Path) -> None:
    """Prints the savings table and writes it to ``out/memory_savings.md``, its data to ``.json``."""
    table = format_savings_table(data)
    print(table, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_savings.md").write_text(table + "\n")
    (out / "memory_savings.json").write_text(json.dumps(data, indent=2) + "\n")
    print(f"memory savings table: {out / 'memory_savings.md'}", flush=True)

"""Logs peak memory per training step and epoch; optionally, what each memory optimisation of the run saves.

Per-step peaks come from :class:`~lit_amp_det.profiling.MemoryProbe`, reset before each step; the savings
comparison lives in :mod:`lit_amp_det.callbacks.memory_savings`, run here before the first step.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from typing_extensions import override

from lit_amp_det.callbacks.memory_savings import (
    BaselineComparison,
    SavingsRow,
    check_comparable,
    write_savings,
)
from lit_amp_det.errors import ArgumentError
from lit_amp_det.profiling import MB, MemoryProbe, StepTimer

__all__ = ["MemoryMonitor"]


class MemoryMonitor(Callback):
    """Logs peak memory per training step and epoch; optionally measures savings against an unoptimised
    baseline.

    Logged every training step: ``memory/step_peak_mb`` (peak during the step), ``memory/in_use_mb``
    (allocated on the GPU, resident set on a CPU, at the end of the step) and, on a GPU,
    ``memory/step_peak_reserved_mb``. Every epoch: ``memory/epoch_peak_mb`` (and
    ``memory/epoch_peak_reserved_mb`` on a GPU).

    With ``compare_baseline``, once per fit: ``memory/<row>_{peak_mb,step_mb,saved_for_backward_mb,
    weight_casts_mb,step_ms}`` for each row (``baseline``, the precision, ``conv_bn_eval``, ``current``) and
    ``memory/{peak,step_memory,saved_for_backward,step_time}_ratio`` of current over baseline. At the end of
    fit the savings table is printed and written to ``<trainer.log_dir>/memory_savings.md`` and ``.json``.

    Args:
        compare_baseline (bool): measure the baseline and per-optimisation rows (costs ``(warmup_steps +
            baseline_steps)`` forward+backward passes per row, and one extra copy of the model while it runs).
            Default: ``False``.
        baseline_steps (int): measured steps per row, on as many distinct training batches where the loader
            has them. Default: 3.
        warmup_steps (int): unmeasured steps per row before those (lazy initialisation, autotuning).
            Default: 3.

    Raises:
        ~lit_amp_det.errors.ArgumentError: (a ``ValueError``) if ``compare_baseline`` is not a bool,
            ``baseline_steps`` is not an integer >= 1 or ``warmup_steps`` is not an integer >= 0.
        ValueError: in ``setup()`` of a fit with ``compare_baseline``, if the module has no ``model`` to copy
            or lacks ``MaskRCNNModule``'s step methods, or the trainer's precision stores parameters in low
            precision without fp32 copies (``*-true`` other than full precision).
    """

    def __init__(
        self, compare_baseline: bool = False, baseline_steps: int = 3, warmup_steps: int = 3
    ) -> None:
        if not isinstance(compare_baseline, bool):
            raise ArgumentError("compare_baseline", compare_baseline, "must be true or false")
        for name, value, low in (("baseline_steps", baseline_steps, 1), ("warmup_steps", warmup_steps, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ArgumentError(name, value, f"must be an integer >= {low}")
        self.compare_baseline, self.baseline_steps, self.warmup_steps = (
            compare_baseline,
            baseline_steps,
            warmup_steps,
        )
        self._comparison: BaselineComparison | None = None
        self._pending_comparison = False
        self._probe: MemoryProbe | None = None
        self._timer: StepTimer | None = None
        self._step_peaks: list[float] = []
        self._step_ms: list[float] = []
        self._reset_epoch()

    @property
    def rows(self) -> list[SavingsRow]:
        """The measured savings rows (empty until the first step of a fit with ``compare_baseline``)."""
        return [] if self._comparison is None else self._comparison.rows

    def _reset_epoch(self) -> None:
        self._epoch_peak_mb, self._epoch_peak_reserved_mb, self._epoch_steps = 0.0, 0.0, 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.compare_baseline:
            check_comparable(trainer, pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._probe, self._timer = MemoryProbe(pl_module.device), StepTimer(pl_module.device)
        if not self._probe.resettable:
            rank_zero_warn(f"MemoryMonitor: {self._probe.source}; per-step CPU peaks are peaks since start")
        self._step_peaks, self._step_ms = [], []
        self._comparison, self._pending_comparison = None, self.compare_baseline
        if self.compare_baseline:
            # drawn now: the batch sampler's copy must be taken before the loader is iterated
            self._comparison = BaselineComparison(self.baseline_steps, self.warmup_steps)
            self._comparison.prepare(trainer, pl_module.device)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self._probe is not None and self._timer is not None
        if self._pending_comparison and self._comparison is not None:
            # here, not at on_train_start: every on_train_epoch_start hook has set the norms' train/eval mode
            self._pending_comparison = False
            self._comparison.run(trainer, pl_module, batch, self._probe)
        self._probe.synchronize()
        self._probe.reset_peak()
        self._timer.start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        probe, timer = self._probe, self._timer
        assert probe is not None and timer is not None
        seconds = timer.stop()
        assert seconds is not None  # no warm-up: every step is timed
        self._step_ms.append(1000.0 * seconds)
        in_use = probe.in_use_bytes()  # before the peak: the peak read then covers it
        peak_mb = probe.peak_bytes() / MB
        self._step_peaks.append(peak_mb)
        self._epoch_peak_mb = max(self._epoch_peak_mb, peak_mb)
        self._epoch_steps += 1
        pl_module.log("memory/step_peak_mb", peak_mb, on_step=True, on_epoch=False, batch_size=1)
        if in_use is not None:
            pl_module.log("memory/in_use_mb", in_use / MB, on_step=True, on_epoch=False, batch_size=1)
        reserved = probe.peak_reserved_bytes()
        if reserved is not None:
            self._epoch_peak_reserved_mb = max(self._epoch_peak_reserved_mb, reserved / MB)
            pl_module.log(
                "memory/step_peak_reserved_mb", reserved / MB, on_step=True, on_epoch=False, batch_size=1
            )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_epoch()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._epoch_steps:
            return
        pl_module.log("memory/epoch_peak_mb", self._epoch_peak_mb, on_step=False, on_epoch=True, batch_size=1)
        if self._probe is not None and self._probe.cuda:
            pl_module.log(
                "memory/epoch_peak_reserved_mb",
                self._epoch_peak_reserved_mb,
                on_step=False,
                on_epoch=True,
                batch_size=1,
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.compare_baseline:
            return
        if not self.rows:
            rank_zero_warn(
                "MemoryMonitor(compare_baseline=True) wrote no savings table: no training step ran"
            )
            return
        # on every rank: Trainer.log_dir broadcasts, which must not happen inside rank_zero_only
        self._write_report(trainer, pl_module, Path(trainer.log_dir or trainer.default_root_dir))

    def report(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The savings table's data: the measured rows, ratios to the baseline and what training observed."""
        assert self._probe is not None and self._comparison is not None
        timed = self._step_ms[self.warmup_steps :] or self._step_ms
        training = {
            "steps": len(self._step_peaks),
            "peak_mb": max(self._step_peaks) if self._step_peaks else None,
            "step_ms_median": statistics.median(timed) if timed else None,
        }
        return self._comparison.report(trainer, pl_module, self._probe.source, training)

    @rank_zero_only
    def _write_report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Path) -> None:
        write_savings(self.report(trainer, pl_module), out)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(compare_baseline={self.compare_baseline}, "
            f"baseline_steps={self.baseline_steps}, warmup_steps={self.warmup_steps})"
        )

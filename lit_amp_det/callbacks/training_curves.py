"""A PNG of the training curves (losses, learning rate, validation mAP) in the run folder, whatever the
logger.

The callback samples ``trainer.callback_metrics`` every few training steps and after each validation, so the
picture exists with any logger or none. It is drawn at the end of ``fit``, also when ``fit`` stops on an
exception, and the samples travel in checkpoints, so a resumed run draws its whole history.
"""

from __future__ import annotations

import fnmatch
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

__all__ = ["DEFAULT_PANELS", "TrainingCurves"]

_FIELD = "callbacks.training_curves"
#: panel title -> metric name patterns (``fnmatch``) drawn in it
DEFAULT_PANELS: dict[str, list[str]] = {
    "losses": ["train/loss*"],
    "learning_rate": ["train/lr"],
    "validation": ["val/bbox_mAP", "val/segm_mAP", "val/bbox_mAP_50", "val/segm_mAP_50"],
}
_VALIDATION_PREFIX = "val/"


class TrainingCurves(Callback):
    """Records logged metrics during ``fit`` and draws them into one PNG, a panel per group of metrics.

    Metrics named ``val/...`` are sampled at the end of each validation (not the sanity check); the others
    every ``every_n_steps`` optimizer steps, from the first. Only metrics that match a panel's patterns are
    kept. The x axis is the global step in every panel; validation points are marked, and dotted lines mark
    epoch ends. Rank zero only.

    Args:
        path: the PNG file.
        every_n_steps: training steps between samples; ``None``: the trainer's ``log_every_n_steps``.
        panels: panel title -> metric name patterns (``fnmatch``, e.g. ``train/loss*``), top to bottom.
    """

    def __init__(
        self,
        path: str | Path,
        every_n_steps: int | None = None,
        panels: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.path = Path(path)
        self.every_n_steps = every_n_steps
        self.panels = {
            str(title): [str(p) for p in patterns]
            for title, patterns in (DEFAULT_PANELS if panels is None else panels).items()
        }
        self.history: dict[str, list[list[float]]] = {}  # metric -> [[step, value], ...]
        self.epoch_ends: list[int] = []
        self._last_step = -1
        self._drawn_after_fit = False  # on_fit_end drew the picture: a validation after it draws again

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        every = self.every_n_steps
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(
                f"{_FIELD}.every_n_steps={every!r} must be an integer >= 1 or null (the trainer's "
                "log_every_n_steps)"
            )
        if not self.panels or any(not patterns for patterns in self.panels.values()):
            raise ValueError(
                f"{_FIELD}.panels={self.panels!r} must map each panel title to a non-empty list of "
                "metric name patterns, e.g. {losses: ['train/loss*']}"
            )

    def _record(self, trainer: pl.Trainer, validation: bool) -> None:
        step = trainer.global_step
        for name, value in trainer.callback_metrics.items():
            if name.startswith(_VALIDATION_PREFIX) != validation or not any(
                fnmatch.fnmatchcase(name, p) for patterns in self.panels.values() for p in patterns
            ):
                continue
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    continue
                value = value.item()
            self.history.setdefault(name, []).append([step, float(value)])

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        every, step = self.every_n_steps or trainer.log_every_n_steps or 1, trainer.global_step
        # once per optimizer step (gradient accumulation calls this hook several times per step)
        due = self._last_step < 0 or step - self._last_step >= every
        if trainer.is_global_zero and step != self._last_step and due:
            self._last_step = step
            self._record(trainer, validation=False)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.epoch_ends.append(trainer.global_step)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            self._record(trainer, validation=True)
            if trainer.state.fn == TrainerFn.VALIDATING and self._drawn_after_fit:
                # the scoring of the final weights that ``fit`` runs after the last epoch (when that epoch did
                # not validate) comes after on_fit_end: draw again, so the picture ends with that point
                self.write()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.write()
            self._drawn_after_fit = True

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if not trainer.is_global_zero or trainer.state.fn != TrainerFn.FITTING:
            return
        try:  # the exception that stopped the run is the one to report
            self.write()
        except Exception as err:
            warnings.warn(
                f"{self.path} not written after the run stopped: {type(err).__name__}: {err}", stacklevel=2
            )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "epoch_ends": self.epoch_ends, "last_step": self._last_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {
            name: [list(point) for point in points] for name, points in state_dict["history"].items()
        }
        self.epoch_ends = list(state_dict["epoch_ends"])
        self._last_step = int(state_dict["last_step"])

    def write(self) -> Path | None:
        """Draws the recorded curves into :attr:`path` (atomically); ``None`` while nothing is recorded."""
        if not self.history:
            return None
        from matplotlib.figure import (
            Figure,
        )  # no pyplot: renders with Agg and never touches the global backend

        fig = Figure(figsize=(9, 2.6 * len(self.panels)), layout="constrained")
        axes = fig.subplots(len(self.panels), 1, sharex=True, squeeze=False)[:, 0]
        for ax, (title, patterns) in zip(axes, self.panels.items()):
            names = sorted(n for n in self.history if any(fnmatch.fnmatchcase(n, p) for p in patterns))
            for name in names:
                steps, values = zip(*self.history[name])
                ax.plot(
                    steps,
                    [v if math.isfinite(v) else math.nan for v in values],
                    label=name,
                    marker="o" if name.startswith(_VALIDATION_PREFIX) else None,
                    markersize=4,
                    linewidth=1.2,
                )
            if names:
                ax.legend(fontsize=7, loc="best")
            else:
                ax.text(
                    0.5,
                    0.5,
                    f"nothing logged matches {patterns}",
                    ha="center",
                    va="center",
                    transform=ax.transAxes,
                    fontsize=8,
                )
            for step in self.epoch_ends if len(self.epoch_ends) <= 100 else ():
                ax.axvline(step, color="0.8", linestyle=":", linewidth=0.8)
            ax.set_title(title, fontsize=9)
            ax.grid(True, alpha=0.3)
        axes[-1].set_xlabel("step (dotted: epoch ends)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            fig.savefig(tmp, format="png", dpi=100)
            os.replace(tmp, self.path)  # a run killed while drawing keeps the previous picture
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk leaves no partial picture behind
            raise
        return self.path

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(path={str(self.path)!r}, every_n_steps={self.every_n_steps}, "
            f"panels={self.panels})"
        )

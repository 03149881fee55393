"""Logs training step time and images per second, for spotting input stalls and comparing optimisations.

A thin adapter over :class:`~lit_amp_det.profiling.StepTimer` that counts images of detection batches. A step
runs from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, optimizer; not data loading
or validation); the progress bar shows a moving median, which one slow step does not move.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import Callback
from typing_extensions import override

from lit_amp_det.profiling import StepTimer, count_images

__all__ = ["Throughput"]

_FIELD = "callbacks.throughput"


class Throughput(Callback):
    """Logs ``train/step_ms`` and ``train/images_per_s`` per training step and their epoch values.

    Per step (after the first ``warmup_steps`` of the fit):

    * ``train/step_ms``: wall-clock time of this step in milliseconds (unsmoothed);
    * ``train/images_per_s``: the median of the last ``window`` steps' images/s; shown in the progress bar.

    Per epoch (over the epoch's timed steps; not logged for an epoch whose steps were all warm-up):

    * ``train/step_ms_epoch``: mean step time;
    * ``train/images_per_s_epoch``: images divided by the time they took (the mean rate, weighted by step
      time, so a short last batch does not skew it).

    Args:
        window: steps in the moving median of the progress-bar value (1: the last step's rate).
        warmup_steps: steps at the start of each fit that are not timed.
        batch_size_fn: returns the number of images in a batch; default :func:`count_images`.
    """

    def __init__(
        self, window: int = 20, warmup_steps: int = 2, batch_size_fn: Callable[[Any], int] | None = None
    ) -> None:
        self.window, self.warmup_steps, self.batch_size_fn = (
            window,
            warmup_steps,
            batch_size_fn or count_images,
        )
        self._clock: Callable[[], float] = time.perf_counter  # tests swap in a fake clock
        self._timer: StepTimer | None = None
        self._rates: deque[float] = deque()
        self._reset_epoch()

    def _reset_epoch(self) -> None:
        self._epoch_steps, self._epoch_seconds, self._epoch_images = 0, 0.0, 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(
                f"{_FIELD}.window={self.window!r} must be an integer >= 1 (steps in the progress-bar "
                "median; 1 shows the last step)"
            )
        if (
            isinstance(self.warmup_steps, bool)
            or not isinstance(self.warmup_steps, int)
            or self.warmup_steps < 0
        ):
            raise ValueError(
                f"{_FIELD}.warmup_steps={self.warmup_steps!r} must be an integer >= 0 (untimed steps at "
                "the start of each fit)"
            )
        if not callable(self.batch_size_fn):
            raise ValueError(
                f"{_FIELD}.batch_size_fn={self.batch_size_fn!r} must be callable (batch -> images)"
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._timer = StepTimer(trainer.strategy.root_device, self.warmup_steps, clock=self._clock)
        self._rates = deque(maxlen=self.window)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_epoch()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        assert self._timer is not None
        self._timer.start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._timer is not None
        seconds = self._timer.stop()
        if seconds is None:
            return  # warm-up step
        images = int(self.batch_size_fn(batch))
        self._rates.append(images / seconds)
        self._epoch_steps += 1
        self._epoch_seconds += seconds
        self._epoch_images += images
        pl_module.log("train/step_ms", 1000.0 * seconds, on_step=True, on_epoch=False, batch_size=images)
        pl_module.log(
            "train/images_per_s",
            statistics.median(self._rates),
            on_step=True,
            on_epoch=False,
            prog_bar=True,
            batch_size=images,
        )

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._epoch_steps:
            return  # every step of this epoch was warm-up
        pl_module.log(
            "train/step_ms_epoch",
            1000.0 * self._epoch_seconds / self._epoch_steps,
            on_step=False,
            on_epoch=True,
            batch_size=1,
        )
        pl_module.log(
            "train/images_per_s_epoch",
            self._epoch_images / self._epoch_seconds,
            on_step=False,
            on_epoch=True,
            batch_size=1,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(window={self.window}, warmup_steps={self.warmup_steps})"

"""Plain-text training progress: a line after the first step, then every N steps or every minute, and the
metrics of every validation.

A progress bar in a file (``nohup``, ``sbatch``, CI logs) keeps only its last state, so this callback writes
lines instead (step, epoch, loss, learning rate, images/s; the first once the first step is done, so that a
slow CPU run shows it started, then every ``every_n_steps`` steps or ``every_n_seconds``, whichever comes
first; the metrics after every validation) through the ``lit_amp_det.progress`` logger, reaching the console
and the run's log file alike. With ``console: auto`` they go to the console only when stdout is not a terminal
(or the progress bar is off).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lit_amp_det.profiling import count_images

__all__ = ["ConsoleLog", "ReadableProgressBar", "emit", "stdout_is_terminal"]

log = logging.getLogger("lit_amp_det.progress")


def stdout_is_terminal() -> bool:
    """Whether stdout is an interactive terminal (``False`` under nohup, sbatch, CI, pipes, files)."""
    return bool(getattr(sys.stdout, "isatty", None) and sys.stdout.isatty())


def emit(message: str, console: bool = True) -> None:
    """Writes ``message`` to the run's log file and, if ``console``, to stdout.

    Under the CLI, Hydra's logging sends ``lit_amp_det.progress`` records to stdout and to ``<command>.log``;
    without configured logging (a notebook calling :func:`~lit_amp_det.app.tasks.train`) the message is
    printed.
    """
    if not logging.getLogger().handlers:
        if console:
            print(message, flush=True)
        return
    if console:
        log.info(message)
        return
    record = log.makeRecord(log.name, logging.INFO, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


class ConsoleLog(Callback):
    """Writes a progress line after the first training step, then every ``every_n_steps`` steps or
    ``every_n_seconds``, whichever comes first, and one per validation.

    Args:
        every_n_steps (int): steps between two lines (step, loss, learning rate, images/s since the last
            line). Default: 50.
        console (bool or str): ``"auto"`` writes lines to the console only when stdout is not a terminal or
            there is no progress bar; ``True`` always, ``False`` never. The run's log file gets every line in
            any case. Default: ``"auto"``.
        every_n_seconds (float): the longest time between two lines while steps complete. Default: 60.0.

    Raises:
        ValueError: if ``every_n_steps`` is not an integer >= 1, ``every_n_seconds`` is not a number > 0, or
            ``console`` is not ``"auto"``, ``True`` or ``False``.
    """

    def __init__(
        self, every_n_steps: int = 50, console: bool | str = "auto", every_n_seconds: float = 60.0
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"ConsoleLog every_n_steps={every_n_steps!r} must be an integer >= 1")
        if (
            isinstance(every_n_seconds, bool)
            or not isinstance(every_n_seconds, (int, float))
            or every_n_seconds <= 0
        ):
            raise ValueError(f"ConsoleLog every_n_seconds={every_n_seconds!r} must be a number > 0")
        if console not in ("auto", True, False):
            raise ValueError(f"ConsoleLog console={console!r}; choose auto, true or false")
        self.every_n_steps, self.every_n_seconds, self.console = (
            every_n_steps,
            float(every_n_seconds),
            console,
        )
        self._first, self._to_console, self._images, self._since = True, True, 0, time.perf_counter()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._to_console = (
            not stdout_is_terminal() or trainer.progress_bar_callback is None
            if self.console == "auto"
            else bool(self.console)
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._images, self._since, self._first = 0, time.perf_counter(), True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._images += count_images(batch) * trainer.world_size
        step, now = trainer.global_step, time.perf_counter()
        due = self._first or step % self.every_n_steps == 0 or now - self._since >= self.every_n_seconds
        if not due and not (trainer.max_steps and step == trainer.max_steps):
            return
        rate = self._images / max(now - self._since, 1e-9)
        self._first, self._images, self._since = False, 0, now
        total = f"/{trainer.max_steps}" if trainer.max_steps and trainer.max_steps > 0 else ""
        parts = [f"step {step}{total}", f"epoch {trainer.current_epoch}"]
        for key, label in (("train/loss", "loss"), ("train/lr", "lr")):
            value = trainer.callback_metrics.get(key)
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                number = float(value)
                parts.append(
                    f"{label} {number:.2e}" if number != 0 and abs(number) < 1e-2 else f"{label} {number:.4f}"
                )
        parts.append(f"{rate:.1f} images/s")
        self._write("  ".join(parts))

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        when = (
            f" after epoch {trainer.current_epoch} (step {trainer.global_step})"
            if trainer.state.fn == "fit"
            else ""
        )
        self._write_metrics(trainer, "val/", f"validation{when}")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write_metrics(trainer, "test/", "test")

    def _write_metrics(self, trainer: pl.Trainer, prefix: str, title: str) -> None:
        values = {
            k: float(v)
            for k, v in sorted(trainer.callback_metrics.items())
            if k.startswith(prefix)
            and isinstance(v, torch.Tensor)
            and v.numel() == 1
            and not k.endswith(("_small", "_medium", "_large"))
        }
        if values:
            self._write(f"{title}: " + "  ".join(f"{k} {v:.4f}" for k, v in values.items()))

    @rank_zero_only
    def _write(self, message: str) -> None:
        emit(message, console=self._to_console)


class ReadableProgressBar(TQDMProgressBar):
    """Lightning's progress bar showing the learning rate in scientific notation (``lr=1.2e-04``)."""

    @override
    def get_metrics(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule
    ) -> dict[str, int | str | float | dict]:
        metrics = super().get_metrics(trainer, pl_module)
        for key, value in metrics.items():
            if key.endswith("lr") and isinstance(value, float):
                metrics[key] = f"{value:.2e}"
        return metrics

"""``checkpoints/last.ckpt``: saved every N steps or M minutes (whichever comes first), at every epoch end,
and when the run is stopped with Ctrl-C or SIGTERM.

A killed run loses at most ``every_n_train_steps`` steps or ``every_n_minutes`` of work, and ``fit
ckpt_path=last`` continues it exactly (saves happen at batch ends, where the data module records its
position). The file is written next to itself and renamed over the old one, so a kill during the save leaves
the previous checkpoint intact.

On the first SIGINT or SIGTERM during training the step in progress (during validation: the batch in progress)
completes, the checkpoint is saved and :class:`RunInterrupted` stops the fit; a second signal exits the
process at once (128 + its number), except during a save, which completes first. Under DDP every rank stops
after the same step.

In a SLURM batch job (:mod:`lit_amp_det.slurm`) ``SIGUSR1`` (``#SBATCH --signal=USR1@90``; submitit's
``SIGUSR2`` in a job it started) does the same and then requeues the job with ``scontrol requeue``; the
requeued attempt resumes from the checkpoint by itself. Signals that follow (SLURM ends a requeued job with
``SIGTERM``) are logged and ignored while the run stops.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from lit_amp_det.slurm import SlurmJob, current_job, requeue, requeue_signal

__all__ = ["LastCheckpoint", "RunInterrupted"]

log = logging.getLogger(__name__)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(Exception):
    """A fit stopped by a signal after saving ``checkpoint`` (``None`` if saving was off); ``requeued_job`` is
    the SLURM job id that ``scontrol requeue`` accepted, if any.

    Args:
        signum (int): the number of the signal that stopped the fit (``signal.SIGINT``, ``signal.SIGTERM``, or
            the SLURM job's requeue signal); ``signal_name`` and :attr:`exit_code` derive from it.
        checkpoint (str, optional): path of the checkpoint saved before stopping; ``None`` if nothing was
            saved.
        global_step (int): the trainer's ``global_step`` when the fit stopped.
        requeued_job (str, optional): the SLURM job id that ``scontrol requeue`` accepted; ``None`` if the job
            was not requeued. Default: ``None``.
    """

    def __init__(
        self, signum: int, checkpoint: str | None, global_step: int, requeued_job: str | None = None
    ) -> None:
        self.signum, self.checkpoint = signum, checkpoint
        self.global_step, self.requeued_job = global_step, requeued_job
        self.signal_name = signal.Signals(signum).name
        super().__init__(
            f"{self.signal_name} received: stopped after step {global_step}"
            + (f", checkpoint {checkpoint}" if checkpoint else "")
            + (f", SLURM job {requeued_job} requeued" if requeued_job else "")
        )

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number (130 for Ctrl-C)."""
        return 128 + self.signum


class LastCheckpoint(Checkpoint):
    """Keeps ``<dirpath>/last.ckpt`` up to date and turns Ctrl-C/SIGTERM into a saved, resumable stop.

    Args:
        dirpath (str or os.PathLike): folder of ``last.ckpt`` (the run's ``checkpoints/``).
        every_n_train_steps (int, optional): save after every N optimizer steps; ``None`` or 0: not by steps.
            Default: 1000.
        every_n_minutes (float, optional): save when this many minutes of training passed since the last
            save; ``None``: not by time. Default: 10.0.
        save_on_signal (bool): on SIGINT/SIGTERM (and, in a SLURM job, its requeue signal) during training,
            save after the current step and stop with :class:`RunInterrupted`. Default: ``True``.
        filename (str): name of the file in ``dirpath``. Default: ``"last.ckpt"``.

    Raises:
        ValueError: if ``every_n_train_steps`` is a bool or negative, or ``every_n_minutes`` is not > 0.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike,
        every_n_train_steps: int | None = 1000,
        every_n_minutes: float | None = 10.0,
        save_on_signal: bool = True,
        filename: str = "last.ckpt",
    ) -> None:
        if every_n_train_steps is not None and (
            isinstance(every_n_train_steps, bool) or every_n_train_steps < 0
        ):
            raise ValueError(
                f"LastCheckpoint every_n_train_steps={every_n_train_steps!r} must be >= 0 or null"
            )
        if every_n_minutes is not None and every_n_minutes <= 0:
            raise ValueError(f"LastCheckpoint every_n_minutes={every_n_minutes!r} must be > 0 or null")
        self.dirpath = Path(dirpath)
        self.every_n_train_steps = every_n_train_steps or 0
        self.every_n_minutes, self.save_on_signal, self.filename = every_n_minutes, save_on_signal, filename
        self.last_model_path = ""
        self.best_model_path = ""  # Lightning's ``Checkpoint`` interface; this callback keeps no "best"
        self._last_saved_step, self._last_saved_time = -1, time.monotonic()
        self._signal: int | None = None
        self._previous_handlers: dict[int, Any] = {}
        self._job: SlurmJob | None = None
        self._requeue_signal: int | None = None  # the job's end-of-time signal, read when training starts
        self._saving = False
        self._stop_now = 0  # a second signal (its number) arrived during a save: exit once it is written

    @property
    def path(self) -> Path:
        return self.dirpath / self.filename

    def save(self, trainer: pl.Trainer) -> str:
        """Writes ``last.ckpt`` now (all ranks must call it: the save is collective under DDP). The trainer's
        checkpoint IO writes it beside the old one and renames it over (``DurableCheckpointIO`` under the
        CLI).
        """
        self._saving = True  # a signal now is answered after the write, never inside it
        try:
            trainer.save_checkpoint(self.path, weights_only=False)
        finally:
            self._saving = False
        self.last_model_path = str(self.path)
        self._last_saved_step = trainer.global_step
        self._last_saved_time = time.monotonic()
        if self._stop_now:
            _exit_now(self._stop_now, f"{self.path} (step {trainer.global_step}) is complete")
        return self.last_model_path

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_saved_time = time.monotonic()
        self._last_saved_step = trainer.global_step  # a resumed run does not save its starting point again
        if self.save_on_signal:
            self._install_handlers()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.save_on_signal and self._signalled(trainer):
            self._stop(trainer)
        if trainer.global_step == self._last_saved_step:
            return
        by_steps = self.every_n_train_steps > 0 and trainer.global_step % self.every_n_train_steps == 0
        by_time = (
            self.every_n_minutes is not None
            and time.monotonic() - self._last_saved_time >= 60.0 * self.every_n_minutes
        )
        if trainer.world_size > 1:  # clocks differ between ranks: rank 0 decides for all
            by_time = bool(trainer.strategy.broadcast(by_time))
        if by_steps or by_time:
            self.save(trainer)

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        """A signal during a fit's validation stops it after the batch in progress, not after the whole split
        (which can outlast a preemption's grace period): the training state, unchanged since validation began,
        is saved.
        """
        during_fit = not trainer.sanity_checking and trainer.state.fn == "fit"
        if self.save_on_signal and during_fit and self._signalled(trainer):
            self._stop(trainer)

    def _signalled(self, trainer: pl.Trainer) -> bool:
        """Whether a stop signal arrived; under DDP, on any rank (all then stop after the same batch)."""
        stop = self._signal is not None
        return trainer.strategy.reduce_boolean_decision(stop, all=False) if trainer.world_size > 1 else stop

    def _stop(self, trainer: pl.Trainer) -> None:
        """Saves, requeues under SLURM if asked, and ends the fit with :class:`RunInterrupted`."""
        signum = self._signal if self._signal is not None else signal.SIGTERM
        saved = self.save(trainer)
        requeued = self._requeue_after_save(trainer, signum)
        self._restore_handlers()
        raise RunInterrupted(signum, saved, trainer.global_step, requeued)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the epoch's validation (and the best checkpoint's update), so the resumed run knows both
        self.save(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore_handlers()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._restore_handlers()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_model_path": self.last_model_path}

    def _requeue_after_save(self, trainer: pl.Trainer, signum: int) -> str | None:
        """Under SLURM, after the save that ``SIGUSR1`` asked for: rank 0 requeues the job; its id if
        requeued.
        """
        asked = self._job is not None and signum == self._requeue_signal
        if trainer.world_size > 1 and self._job is not None:
            asked = trainer.strategy.reduce_boolean_decision(asked, all=False)
        if not asked or self._job is None:
            return None
        requeued = requeue(self._job) if trainer.is_global_zero else False
        if trainer.world_size > 1:
            requeued = bool(trainer.strategy.broadcast(requeued))
        return self._job.job_id if requeued else None

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        self._signal, self._stop_now = None, 0
        self._job = current_job()
        self._requeue_signal = requeue_signal() if self._job is not None else None
        signals = (*_SIGNALS, self._requeue_signal) if self._requeue_signal is not None else _SIGNALS
        for signum in signals:
            self._previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous_handlers = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._signal is not None and self._job is not None:  # SLURM's SIGTERM after a requeue, or a repeat
            _announce(f"{name} received while stopping: ignored, {self.path} is saved after this step")
            return
        if self._signal is not None:  # the second signal: stop now, without saving (after a save in progress)
            if self._saving:
                self._stop_now = signum
                return
            _exit_now(
                signum, f"{self.path} is as the last save left it" if self.path.is_file() else "no checkpoint"
            )
        self._signal = signum
        if self._job is not None and signum == self._requeue_signal:
            _announce(
                f"{name} received: saving {self.path} after this step, then requeueing SLURM job "
                f"{self._job.job_id} and stopping"
            )
            return
        _announce(
            f"{name} received: saving {self.path} after this step, then stopping "
            "(send it again to stop at once without saving)"
        )


def _exit_now(signum: int, kept: str) -> None:
    """Exits the process at once with 128 + ``signum``, after one line saying so: the answer to a second
    signal. Lightning's handler would tear the run down first, which takes seconds to minutes.
    """
    _announce(f"{signal.Signals(signum).name} received again: stopped at once; {kept}")
    logging.shutdown()
    os._exit(128 + signum)


@rank_zero_only
def _announce(message: str) -> None:
    log.warning(message)

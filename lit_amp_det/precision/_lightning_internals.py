"""The private Lightning API the precision plugins use, one function each, so that a Lightning upgrade that
changes it breaks here rather than somewhere inside a training step.

Checked against lightning 2.6.6. Each function says why no public hook does the job.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision

__all__ = ["carry_step_count", "count_manual_step", "run_after_closure_hooks"]


def run_after_closure_hooks(
    plugin: Precision, model: pl.LightningModule, optimizer: torch.optim.Optimizer
) -> None:
    """Runs what Lightning runs between backward and the optimizer step: the callbacks' and the module's
    ``on_before_optimizer_step`` hooks, then gradient clipping as the Trainer is configured
    (``trainer.gradient_clip_val`` / ``gradient_clip_algorithm``, through ``configure_gradient_clipping``).

    Why private: a plugin that must act between the hooks and ``optimizer.step()`` (GradScaler's unscale
    before clipping, the non-finite guard's check after it) cannot hand Lightning a closure and let
    ``optimizer.step`` run it; Lightning's own ``MixedPrecision.optimizer_step`` calls
    ``Precision._after_closure(model, optimizer)`` for this.
    """
    plugin._after_closure(model, optimizer)


def _manual_progress(trainer: pl.Trainer) -> Any:
    return trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress


def count_manual_step(trainer: pl.Trainer) -> None:
    """Counts one optimizer step of manual optimisation (``trainer.global_step`` reads this count).

    Why private: Lightning counts a manual step in ``LightningOptimizer.step``, which also runs the precision
    plugin's ``optimizer_step``; a step replayed from a CUDA graph (``lit_amp_det.callbacks.cuda_graph``) has
    taken it already.
    """
    progress = _manual_progress(trainer)
    progress.increment_ready()
    progress.increment_completed()


def carry_step_count(trainer: pl.Trainer, to_manual: bool) -> None:
    """Raises the manual optimisation's optimizer-step count (``to_manual``) or the automatic one to the
    other's, so ``trainer.global_step`` keeps its value when a module switches between the two (a run resumed
    under manual optimisation from a checkpoint of automatic optimisation, and back after it).

    Why private: Lightning keeps the two counts apart and restores both from a checkpoint; no hook carries one
    over.
    """
    manual = _manual_progress(trainer).total
    automatic = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    source, target = (automatic, manual) if to_manual else (manual, automatic)
    if target.completed < source.completed:
        target.ready = target.completed = source.completed

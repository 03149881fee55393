"""The private Lightning API the precision plugins use, one function each, so that a Lightning upgrade that changes
it breaks here rather than somewhere inside a training step.

Checked against lightning 2.6.6. Each function says why no public hook does the job.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision

__all__ = ["run_after_closure_hooks"]


def run_after_closure_hooks(plugin: Precision, model: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
    """Runs what Lightning runs between backward and the optimizer step: the callbacks' and the module's
    ``on_before_optimizer_step`` hooks, then gradient clipping as the Trainer is configured
    (``trainer.gradient_clip_val`` / ``gradient_clip_algorithm``, through ``configure_gradient_clipping``).

    Why private: a plugin that must act between the hooks and ``optimizer.step()`` (GradScaler's unscale before
    clipping, the non-finite guard's check after it) cannot hand Lightning a closure and let ``optimizer.step`` run it;
    Lightning's own ``MixedPrecision.optimizer_step`` calls ``Precision._after_closure(model, optimizer)`` for this.
    """
    plugin._after_closure(model, optimizer)

"""``trainer.precision=32-true`` with the non-finite step guard: no autocast, no casting, no loss scaling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from lit_amp_det.precision.guard import (
    MAX_CONSECUTIVE_SKIPS,
    SKIP_CHECK_EVERY_N_STEPS,
    NonFiniteStepGuard,
    guarded_optimizer_step,
)
from lit_amp_det.precision.state import load_recorded_state, recorded_state

__all__ = ["FiniteStepPrecision"]


class FiniteStepPrecision(Precision):
    """``32-true`` whose optimizer steps are skipped (on the device) when a gradient is inf or NaN.

    Args:
        max_consecutive_skips, skip_check_every_n_steps: the guard's settings
            (:class:`~lit_amp_det.precision.guard.NonFiniteStepGuard`).
    """

    precision = "32-true"

    def __init__(
        self,
        max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS,
        skip_check_every_n_steps: int = SKIP_CHECK_EVERY_N_STEPS,
    ) -> None:
        super().__init__()
        self.guard = NonFiniteStepGuard(self.precision, max_consecutive_skips, skip_check_every_n_steps)

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        model: pl.LightningModule,  # type: ignore[override]
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        return guarded_optimizer_step(
            self, self.guard, optimizer, model, closure, self.step_if_finite, **kwargs
        )

    def step_if_finite(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        """The step after backward and Lightning's hooks, skipped on the device when a gradient is not finite."""
        self.guard.step(optimizer, **kwargs)

    @override
    def state_dict(self) -> dict[str, Any]:
        return recorded_state(self.precision, self.guard)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_recorded_state(state_dict, self.guard)

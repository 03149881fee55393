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
from lit_amp_det.precision.plugin import DetectionPrecision
from lit_amp_det.precision.state import load_recorded_state, recorded_state

__all__ = ["FiniteStepPrecision"]


class FiniteStepPrecision(Precision, DetectionPrecision):
    """``32-true`` whose optimizer steps are skipped (on the device) when a gradient is inf or NaN.

    Args:
        max_consecutive_skips (int): stop the run as diverged once this many steps in a row were skipped
            (``precision.max_consecutive_skips``; its default is ``PrecisionSettings``').
        skip_check_every_n_steps (int): read the skip counters on the host every this many steps
            (``precision.skip_check_every_n_steps``; its default is ``PrecisionSettings``').

    Raises:
        ValueError: if ``max_consecutive_skips`` or ``skip_check_every_n_steps`` is < 1 (from
            :class:`~lit_amp_det.precision.guard.NonFiniteStepGuard`).
    """

    precision = "32-true"

    def __init__(
        self,
        max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS,
        skip_check_every_n_steps: int = SKIP_CHECK_EVERY_N_STEPS,
    ) -> None:
        super().__init__()
        # fp32 throughout: no loss to scale, no low dtype to compute in
        self.scaler: torch.amp.GradScaler | None = None
        self.low_dtype: torch.dtype | None = None
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
        """The step after backward and Lightning's hooks, skipped on the device when a gradient is inf/NaN."""
        self.guard.step(optimizer, **kwargs)

    @override
    def state_dict(self) -> dict[str, Any]:
        return recorded_state(self.precision, self.guard)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_recorded_state(state_dict, self.guard)

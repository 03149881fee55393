"""``trainer.precision=16-mixed|bf16-mixed``: Lightning's autocast plugin with fp32 regions and the step
guard.

:class:`DetectionMixedPrecision` is Lightning's ``MixedPrecision`` (autocast in the forward, a GradScaler for
fp16) with two additions: the fp32 regions of :mod:`lit_amp_det.precision.regions`, installed by
``convert_module``, and the non-finite step guard of :mod:`lit_amp_det.precision.guard`. bf16 has no
GradScaler, so the guard checks and skips its steps on the device; fp16 keeps GradScaler's own skipping and
the guard only counts the skips.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from typing_extensions import override

from lit_amp_det.precision.guard import guarded_optimizer_step
from lit_amp_det.precision.modes import MIXED_PRECISIONS
from lit_amp_det.precision.options import HalfPrecisionOptions, half_dtype
from lit_amp_det.precision.plugin import DetectionPrecision
from lit_amp_det.precision.regions import install_fp32_regions, regions_for
from lit_amp_det.precision.skip import gradients, non_finite
from lit_amp_det.precision.state import load_recorded_state, recorded_state

__all__ = ["DetectionMixedPrecision"]


class DetectionMixedPrecision(MixedPrecision, DetectionPrecision):
    """``16-mixed`` / ``bf16-mixed`` autocast with fp32 regions, dynamic loss scaling (fp16) and the step
    guard.

    Args:
        precision: ``16-mixed`` (fp16 with a GradScaler) or ``bf16-mixed``.
        device: ``cuda`` or ``cpu`` (the autocast device type).
        **options: the fields of :class:`~lit_amp_det.precision.options.HalfPrecisionOptions`.
    """

    def __init__(self, precision: Literal["16-mixed", "bf16-mixed"], device: str, **options: Any) -> None:
        if precision not in MIXED_PRECISIONS:
            raise ValueError(
                f"DetectionMixedPrecision takes {' or '.join(MIXED_PRECISIONS)}, not {precision!r}; "
                "build_precision_plugin gives each trainer.precision value its plugin"
            )
        settings = HalfPrecisionOptions(**options)
        super().__init__(precision, device, settings.scaler(precision, device))
        self.fp32_regions, self.guard = settings.regions(), settings.guard(precision)
        self.low_dtype = half_dtype(precision)

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Installs the fp32 regions in place (Lightning's DDP ignores the returned module)."""
        install_fp32_regions(module, regions_for(module, self.fp32_regions), self.low_dtype)
        return module

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        model: pl.LightningModule,  # type: ignore[override]
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self.scaler is None:
            return guarded_optimizer_step(
                self, self.guard, optimizer, model, closure, self.step_if_finite, **kwargs
            )
        found: list[Tensor] = []

        def checked_closure() -> Any:
            result = closure()
            if result is not None or not model.automatic_optimization:  # Lightning's step unscales and steps
                found.append(
                    non_finite(gradients(optimizer))
                )  # what GradScaler finds: inf/NaN scaled gradients
            return result

        result = super().optimizer_step(optimizer, model=model, closure=checked_closure, **kwargs)
        if found:
            self.guard.record(found[0])
            self.guard.log(model)
        return result

    def step_if_finite(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        """The step after backward and Lightning's hooks (bf16), skipped on the device when a gradient is not
        finite; fp16 steps through its GradScaler instead.
        """
        if self.scaler is not None:
            raise RuntimeError(
                f"trainer.precision={self.precision} steps through its GradScaler "
                "(scaler.step(optimizer)), not step_if_finite"
            )
        self.guard.step(optimizer, **kwargs)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **recorded_state(self.precision, self.guard)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        scaler_state = load_recorded_state(state_dict, self.guard)
        if scaler_state:
            super().load_state_dict(scaler_state)

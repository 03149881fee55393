"""``trainer.precision=bf16-weights|16-weights``: bf16/fp16 weights with fp32 masters in the optimizer, no
autocast.

MMCV's ``wrap_fp16_model`` + ``Fp16OptimizerHook`` as a Lightning plugin; the conversion itself is
:func:`~lit_amp_det.precision.master_weights.use_low_precision_weights`. Autocast casts every weight to the
low dtype each time an op uses it; here the weights are in the low dtype already, so those casts go away,
while the optimizer steps fp32 masters so that small updates are not lost to bf16/fp16 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torchvision.ops
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from typing_extensions import override

from lit_amp_det.precision._lightning_internals import run_after_closure_hooks
from lit_amp_det.precision.casting import wrap_method
from lit_amp_det.precision.guard import guarded_optimizer_step
from lit_amp_det.precision.master_weights import MasterWeights, use_low_precision_weights
from lit_amp_det.precision.modes import LOW_PRECISION_WEIGHTS
from lit_amp_det.precision.options import HalfPrecisionOptions, half_dtype
from lit_amp_det.precision.plugin import DetectionPrecision
from lit_amp_det.precision.regions import install_fp32_regions, regions_for
from lit_amp_det.precision.skip import gradients, non_finite
from lit_amp_det.precision.state import load_recorded_state, recorded_state

__all__ = ["MasterWeightPrecision"]

#: torchvision's RoI ops: their kernels refuse bf16/fp16 features with fp32 boxes outside autocast (whose
#: kernel casts both to fp32), so under low-precision weights they run as fp32 regions (lit_amp_det's own ops
#: take both).
_TORCHVISION_ROI_OPS = (
    torchvision.ops.MultiScaleRoIAlign,
    torchvision.ops.RoIAlign,
    torchvision.ops.RoIPool,
    torchvision.ops.PSRoIAlign,
    torchvision.ops.PSRoIPool,
)


class MasterWeightPrecision(Precision, DetectionPrecision):
    """``bf16-weights`` / ``16-weights``: bf16/fp16 weights, fp32 masters in the optimizer, no autocast.

    What stays fp32 is as :mod:`lit_amp_det.precision.master_weights` says. After backward the low-precision
    gradients move to the fp32 masters, so gradient clipping and the non-finite check see fp32 gradients: from
    ``on_before_optimizer_step`` on, the gradients are the ``.grad`` of ``optimizer.param_groups``' tensors
    (the masters), not of ``model.parameters()``. ``16-weights`` scales the loss with a GradScaler and
    unscales the master gradients before clipping; ``bf16-weights`` steps through the non-finite guard.

    Args:
        precision: ``bf16-weights`` or ``16-weights``.
        device: ``cuda`` or ``cpu`` (the GradScaler's device).
        **options: the fields of :class:`~lit_amp_det.precision.options.HalfPrecisionOptions`, as for
            :class:`~lit_amp_det.precision.mixed.DetectionMixedPrecision`.
    """

    def __init__(self, precision: Literal["16-weights", "bf16-weights"], device: str, **options: Any) -> None:
        if precision not in LOW_PRECISION_WEIGHTS:
            raise ValueError(
                f"MasterWeightPrecision takes {' or '.join(LOW_PRECISION_WEIGHTS)}, not {precision!r}; "
                "build_precision_plugin gives each trainer.precision value its plugin"
            )
        super().__init__()
        settings = HalfPrecisionOptions(**options)
        self.precision = precision  # type: ignore[assignment]
        self.device = device
        self.scaler = settings.scaler(precision, device)
        self.fp32_regions = settings.regions()
        self.guard = settings.guard(precision)
        self.low_dtype = half_dtype(precision)
        self.weights: MasterWeights | None = None

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Installs the fp32 regions and converts the weights, in place (idempotent: fit, then validate)."""
        install_fp32_regions(module, regions_for(module, self.fp32_regions), self.low_dtype)
        for submodule in module.modules():
            if type(submodule) in _TORCHVISION_ROI_OPS:
                wrap_method(submodule, "forward", "fp32")
        self.weights = use_low_precision_weights(module, self.low_dtype)
        return module

    @override
    def connect(
        self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Points every optimizer at the fp32 masters (Lightning calls this once the optimizers exist)."""
        for optimizer in optimizers:
            self._master_weights().attach(optimizer)
        return model, optimizers, lr_schedulers

    def _master_weights(self) -> MasterWeights:
        if self.weights is None:
            raise RuntimeError(
                f"trainer.precision={self.precision}: the model has no fp32 masters yet; call the "
                "plugin's convert_module(model) before connecting optimizers (Lightning's Trainer does "
                "both)"
            )
        return self.weights

    @override
    def pre_backward(self, tensor: Tensor, module: pl.LightningModule) -> Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        model: pl.LightningModule,  # type: ignore[override]
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        weights = self._master_weights()

        def closure_then_masters() -> Any:
            result = closure()
            weights.grads_to_masters()  # before the hooks, clipping and the non-finite check
            return result

        scaler = self.scaler
        if scaler is None:
            return guarded_optimizer_step(
                self, self.guard, optimizer, model, closure_then_masters, self.step_if_finite, **kwargs
            )
        # Lightning's MixedPrecision.optimizer_step with a GradScaler, on the masters' gradients
        closure_result = closure_then_masters()
        found = None
        if (
            closure_result is not None or not model.automatic_optimization
        ):  # else backward was skipped on purpose
            found = non_finite(gradients(optimizer))  # what GradScaler finds: inf/NaN scaled gradients
            scaler.unscale_(optimizer)  # the masters' fp32 gradients, so that clipping sees true values
        run_after_closure_hooks(self, model, optimizer)
        if found is None:
            return closure_result
        scaler.step(optimizer, **kwargs)  # skipped (no refresh either) when a gradient is inf/NaN
        scaler.update()
        self.guard.record(found)
        self.guard.log(model)
        return closure_result

    def step_if_finite(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> None:
        """The step after backward and Lightning's hooks (``bf16-weights``): gradients to the masters, then
        ``optimizer.step()`` skipped on the device when a gradient is not finite, then the weights from the
        masters.
        """
        weights = self._master_weights()
        weights.grads_to_masters()  # a no-op when optimizer_step's closure moved them already
        self.guard.step(optimizer, **kwargs)
        # the optimizer's post-step hook refreshed the weights before a skipped step's masters were put back
        weights.refresh()

    @override
    def state_dict(self) -> dict[str, Any]:
        scaler_state = self.scaler.state_dict() if self.scaler is not None else {}
        return {**scaler_state, **recorded_state(self.precision, self.guard)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        scaler_state = load_recorded_state(state_dict, self.guard)
        if scaler_state and self.scaler is not None:
            self.scaler.load_state_dict(scaler_state)

"""Lightning precision plugins for detection: autocast or low-precision weights with fp32 regions, loss scaling,
non-finite guard.

Plain autocast is not enough for detection: losses, box coding, proposal filtering and mask pasting lose
accuracy or overflow in half precision. :class:`DetectionMixedPrecision` extends Lightning's
``MixedPrecision`` with *fp32 regions* -- methods of the model that run with autocast disabled on fp32
inputs (or whose outputs are cast to fp32) -- installed in place on the module, so it also works under DDP,
where Lightning ignores the module ``convert_module`` returns. :class:`MasterWeightPrecision` keeps the same
regions but no autocast: the weights themselves are bf16/fp16 and the optimizer steps fp32 masters
(:mod:`lit_amp_det.precision.master_weights`), which saves autocast's per-step weight casts. All plugins skip
optimizer steps whose gradients are not finite (GradScaler does this for fp16; here bf16 and fp32 get it too),
count and log the skips, and stop with an actionable error after too many in a row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torchvision.ops
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lit_amp_det.ops.optim_step import all_finite
from lit_amp_det.precision.casting import set_mixed_precision, wrap_method
from lit_amp_det.precision.fused_master_step import (
    clip_coefficient,
    fused_master_sgd_step,
    gradients_finite,
    release_low_gradients,
    step_gradients,
    unfused_reason,
)
from lit_amp_det.precision.hardware import resolve_precision
from lit_amp_det.precision.master_weights import MasterWeights, use_low_precision_weights
from lit_amp_det.precision.modes import LOW_PRECISION_WEIGHTS, MIXED_PRECISIONS, PRECISIONS, REGION_MODES, RegionMode

__all__ = [
    "PRECISION_KEY",
    "DetectionMixedPrecision",
    "FiniteStepPrecision",
    "MasterWeightPrecision",
    "NonFiniteStepGuard",
    "build_precision_plugin",
    "install_fp32_regions",
    "trained_precision",
    "warn_if_precision_changes",
]

log = logging.getLogger(__name__)

#: the key under which each plugin's checkpoint state records the precision that trained it (see trained_precision)
PRECISION_KEY = "precision"



class NonFiniteStepGuard:
    """Counts optimizer steps skipped for non-finite gradients; raises after ``max_consecutive`` in a row."""

    def __init__(self, max_consecutive: int = 20) -> None:
        if max_consecutive < 1:
            raise ValueError(f"precision.max_consecutive_skips must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.skipped = 0
        self.consecutive = 0

    def record(self, stepped: bool, model: pl.LightningModule, precision: str) -> None:
        if stepped:
            self.consecutive = 0
        else:
            self.skipped += 1
            self.consecutive += 1
        model.log("train/skipped_steps", float(self.skipped), on_step=True, on_epoch=False, prog_bar=False)
        if self.consecutive >= self.max_consecutive:
            raise RuntimeError(
                f"{self.consecutive} consecutive optimizer steps had non-finite gradients under "
                f"trainer.precision={precision} ({self.skipped} skipped in all); training has diverged. Lower the "
                "learning rate (optim.optimizer.lr), clip gradients (trainer.gradient_clip_val=1.0), or raise "
                "precision.max_consecutive_skips. Checkpoints written so far are kept."
            )

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "consecutive": self.consecutive}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.consecutive = int(state.get("consecutive", 0))


def _grads_finite(optimizer: torch.optim.Optimizer) -> bool:
    """No gradient of the optimizer's parameters is inf or NaN (one read of each: :func:`lit_amp_det.ops.all_finite`;
    ``isfinite(g).all()`` per gradient wrote a bool tensor of each first, ~15 ms a step on R50-FPN's gradients)."""
    return all_finite([p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None])


def _finite_then_step(optimizer: torch.optim.Optimizer, **kwargs: Any) -> bool:
    """Steps ``optimizer`` when every gradient is finite, else drops the gradients; returns whether it stepped."""
    if not _grads_finite(optimizer):
        optimizer.zero_grad(set_to_none=True)
        return False
    optimizer.step(**kwargs)
    return True


def _step_if_finite(
    plugin: Precision,
    guard: NonFiniteStepGuard,
    optimizer: torch.optim.Optimizer,
    model: pl.LightningModule,
    closure: Callable[[], Any],
    **kwargs: Any,
) -> Any:
    """Runs forward/backward, then steps only if every gradient is finite (no scaler involved)."""
    closure_result = closure()
    plugin._after_closure(model, optimizer)  # on_before_optimizer_step hooks and gradient clipping
    if closure_result is None and model.automatic_optimization:
        return None  # the training step skipped backward on purpose
    guard.record(plugin.step_if_finite(optimizer, **kwargs), model, plugin.precision)
    return closure_result


def _resolve(root: nn.Module, path: str) -> tuple[object, str]:
    owner: object = root
    *parents, name = path.split(".")
    for part in parents:
        if not hasattr(owner, part):
            raise ValueError(
                f"precision.fp32_regions names {path!r}, but {type(owner).__name__} has no attribute {part!r}; "
                "paths are relative to the LightningModule, e.g. 'model.rpn.compute_loss'"
            )
        owner = getattr(owner, part)
    if owner is None:
        raise ValueError(f"precision.fp32_regions names {path!r}, whose owner is None (e.g. no mask head)")
    if not callable(getattr(owner, name, None)):
        raise ValueError(
            f"precision.fp32_regions names {path!r}, but {type(owner).__name__} has no method {name!r}; "
            "paths are relative to the LightningModule, e.g. 'model.rpn.compute_loss'"
        )
    return owner, name


def install_fp32_regions(module: nn.Module, regions: Mapping[str, RegionMode], dtype: torch.dtype) -> None:
    """Marks ``module`` for mixed precision in ``dtype`` and wraps each region method in place (idempotent)."""
    set_mixed_precision(module, dtype)  # also switches on the module's own @force_fp32/@auto_fp16 methods
    for path, mode in regions.items():
        if mode not in REGION_MODES:
            raise ValueError(f"precision.fp32_regions[{path!r}]={mode!r}; choose one of {', '.join(REGION_MODES)}")
        owner, name = _resolve(module, path)
        if not isinstance(owner, nn.Module):
            set_mixed_precision(owner, dtype)  # plain helpers such as torchvision's BoxCoder
        wrap_method(owner, name, mode)



#: the half dtype of each mixed or low-precision-weights ``trainer.precision``
_LOW_DTYPES: dict[str, torch.dtype] = {
    "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16, "16-weights": torch.float16, "bf16-weights": torch.bfloat16,
}


def _check_precision(precision: str, accepted: tuple[str, ...], plugin: str) -> None:
    if precision not in accepted:
        raise ValueError(f"trainer.precision={precision!r}; {plugin} takes {' or '.join(accepted)}")


def _fp16_scaler(precision: str, device: str, init_scale: float, growth_interval: int) -> torch.amp.GradScaler | None:
    """A GradScaler for the fp16 precisions (fp16 gradients underflow without one); None for bf16."""
    if not precision.startswith("16-"):
        return None
    return torch.amp.GradScaler(device, init_scale=init_scale, growth_interval=growth_interval)


def _regions_for(module: nn.Module, configured: Mapping[str, RegionMode] | None) -> Mapping[str, RegionMode]:
    """The configured fp32 regions, or the module's own ``fp32_regions()`` when none are configured."""
    if configured is not None:
        return configured
    return module.fp32_regions() if hasattr(module, "fp32_regions") else {}


class FiniteStepPrecision(Precision):
    """``32-true`` with the non-finite step guard (no autocast, no casting)."""

    precision = "32-true"

    def __init__(self, max_consecutive_skips: int = 20) -> None:
        super().__init__()
        self.guard = NonFiniteStepGuard(max_consecutive_skips)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        return _step_if_finite(self, self.guard, optimizer, model, closure, **kwargs)

    def step_if_finite(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> bool:
        """The step after backward and the hooks: ``optimizer.step()`` when every gradient is finite."""
        return _finite_then_step(optimizer, **kwargs)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"guard": self.guard.state_dict(), PRECISION_KEY: self.precision}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.guard.load_state_dict(state_dict.get("guard", {}))


class DetectionMixedPrecision(MixedPrecision):
    """``16-mixed`` / ``bf16-mixed`` autocast with fp32 regions, dynamic loss scaling and the step guard.

    Args:
        precision: ``16-mixed`` (fp16 with a GradScaler) or ``bf16-mixed``.
        device: ``cuda`` or ``cpu`` (the autocast device type).
        fp32_regions: method paths relative to the LightningModule mapped to ``fp32`` (inputs cast to fp32,
            autocast off) or ``fp32_outputs`` (run as usual, outputs cast to fp32). ``None`` takes the
            module's ``fp32_regions()``; an empty mapping turns regions off (plain autocast).
        init_scale, growth_interval: GradScaler settings for ``16-mixed``.
        max_consecutive_skips: stop after this many non-finite steps in a row.
    """

    def __init__(
        self,
        precision: Literal["16-mixed", "bf16-mixed"],
        device: str,
        *,
        fp32_regions: Mapping[str, RegionMode] | None = None,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        max_consecutive_skips: int = 20,
    ) -> None:
        _check_precision(precision, MIXED_PRECISIONS, "DetectionMixedPrecision")
        super().__init__(precision, device, _fp16_scaler(precision, device, init_scale, growth_interval))
        self.fp32_regions = None if fp32_regions is None else dict(fp32_regions)
        self.guard = NonFiniteStepGuard(max_consecutive_skips)

    @property
    def low_dtype(self) -> torch.dtype:
        return _LOW_DTYPES[self.precision]

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Installs the fp32 regions in place (Lightning's DDP ignores the returned module)."""
        install_fp32_regions(module, _regions_for(module, self.fp32_regions), self.low_dtype)
        return module

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.scaler is None:
            return _step_if_finite(self, self.guard, optimizer, model, closure, **kwargs)
        outcome: dict[str, Any] = {}

        def tracked_closure() -> Any:
            outcome["loss"] = closure()
            return outcome["loss"]

        scale = self.scaler.get_scale()
        result = super().optimizer_step(optimizer, model=model, closure=tracked_closure, **kwargs)
        if outcome.get("loss") is not None:
            # GradScaler lowers its scale exactly when it skipped the step for inf/NaN gradients
            self.guard.record(self.scaler.get_scale() >= scale, model, self.precision)
        return result

    def step_if_finite(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> bool:
        """The step after backward and the hooks (bf16; fp16 steps through its GradScaler instead)."""
        if self.scaler is not None:
            raise RuntimeError(f"trainer.precision={self.precision} steps through its GradScaler "
                               "(scaler.step(optimizer)), not step_if_finite")
        return _finite_then_step(optimizer, **kwargs)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "guard": self.guard.state_dict(), PRECISION_KEY: self.precision}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        self.guard.load_state_dict(state.pop("guard", {}))
        state.pop(PRECISION_KEY, None)
        if state:
            super().load_state_dict(state)


#: torchvision's RoI ops: their kernels refuse bf16/fp16 features with fp32 boxes outside autocast (whose kernel
#: casts both to fp32), so under low-precision weights they run as fp32 regions (lit_amp_det's own ops take both).
_TORCHVISION_ROI_OPS = (torchvision.ops.MultiScaleRoIAlign, torchvision.ops.RoIAlign, torchvision.ops.RoIPool,
                        torchvision.ops.PSRoIAlign, torchvision.ops.PSRoIPool)


class MasterWeightPrecision(Precision):
    """``bf16-weights`` / ``16-weights``: bf16/fp16 weights, fp32 masters in the optimizer, no autocast.

    MMCV's ``wrap_fp16_model`` + ``Fp16OptimizerHook`` as a Lightning plugin (the conversion itself:
    :func:`~lit_amp_det.precision.master_weights.use_low_precision_weights`). Norm layers, buffers and the fp32
    regions stay fp32, as under :class:`DetectionMixedPrecision`. After backward the low-precision gradients move
    to the fp32 masters, so gradient clipping and the non-finite check see fp32 gradients; the optimizer steps the
    masters and the weights are refreshed from them. From ``on_before_optimizer_step`` on, the gradients are the
    ``.grad`` of ``optimizer.param_groups``' tensors (the masters), not of ``model.parameters()``. ``16-weights``
    scales the loss with a GradScaler (fp16 gradients underflow without it) and unscales the master gradients before
    clipping. ``state_dict()`` of the model, hence every checkpoint, holds the fp32 masters.

    Args:
        precision: ``bf16-weights`` or ``16-weights``.
        device: ``cuda`` or ``cpu`` (the GradScaler's device).
        fp32_regions, init_scale, growth_interval, max_consecutive_skips: as for :class:`DetectionMixedPrecision`.
        fused_master_step: step a ``torch.optim.SGD`` in one pass from the low-precision gradients
            (:mod:`lit_amp_det.precision.fused_master_step`: no fp32 gradients, 20 instead of 32 bytes of memory
            traffic per parameter). Taken where it applies: ``bf16-weights`` (no GradScaler), ``torch.optim.SGD`` (or
            ``lit_amp_det.optim.SGD``),
            no value clipping, parameters on the CPU (the kernel is CPU-only so far); anything else steps
            through the hooks. With it, hooks from
            ``on_before_optimizer_step`` on see the gradients on ``model.parameters()`` (bf16/fp16), not on the
            masters, and norm clipping is computed from them in fp32 (the same coefficient).
    """

    def __init__(
        self,
        precision: Literal["16-weights", "bf16-weights"],
        device: str,
        *,
        fp32_regions: Mapping[str, RegionMode] | None = None,
        init_scale: float = 2.0**16,
        growth_interval: int = 2000,
        max_consecutive_skips: int = 20,
        fused_master_step: bool = True,
    ) -> None:
        _check_precision(precision, LOW_PRECISION_WEIGHTS, "MasterWeightPrecision")
        super().__init__()
        self.precision = precision  # type: ignore[assignment]
        self.device = device
        self.scaler = _fp16_scaler(precision, device, init_scale, growth_interval)
        self.fp32_regions = None if fp32_regions is None else dict(fp32_regions)
        self.guard = NonFiniteStepGuard(max_consecutive_skips)
        self.weights: MasterWeights | None = None
        self.fused_master_step = bool(fused_master_step)
        self._value_clipping = False  # the Trainer clips by value: the fused step does not (see fuses)
        self._clip_scale: float | None = None  # set by clip_grad_by_norm during a fused step's hooks
        self._told_unfused = False

    @property
    def low_dtype(self) -> torch.dtype:
        return _LOW_DTYPES[self.precision]

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Installs the fp32 regions and converts the weights, in place (idempotent: fit, then validate)."""
        install_fp32_regions(module, _regions_for(module, self.fp32_regions), self.low_dtype)
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
                f"trainer.precision={self.precision}: the model has no fp32 masters yet; call the plugin's "
                "convert_module(model) before connecting optimizers (Lightning's Trainer does both)"
            )
        return self.weights

    @override
    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def fuses(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the next step of ``optimizer`` is the fused master step (``fused_master_step`` and it applies)."""
        if not self.fused_master_step or self.scaler is not None:
            return False
        reason = "the Trainer clips gradients by value" if self._value_clipping else unfused_reason(optimizer)
        if reason is not None and not self._told_unfused:
            self._told_unfused = True
            log.info("precision.fused_master_step: %s, so the optimizer steps the fp32 masters through its hooks",
                     reason)
        return reason is None

    def step_if_finite(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> bool:
        """The step after backward and the hooks: the fused master step, or gradients to the masters then
        ``optimizer.step()``, when every gradient is finite; returns whether it stepped."""
        weights = self._master_weights()
        if not self.fuses(optimizer):
            weights.grads_to_masters()  # a no-op when optimizer_step's closure moved them already
            return _finite_then_step(optimizer, **kwargs)
        if not gradients_finite(weights, optimizer):
            release_low_gradients(weights)
            optimizer.zero_grad(set_to_none=True)
            return False
        fused_master_sgd_step(weights, optimizer, 1.0 if self._clip_scale is None else self._clip_scale)
        optimizer._opt_called = True  # type: ignore[attr-defined]  # what an LR scheduler's wrapper of step() records
        return True

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:
        """Under the fused step, the coefficient ``clip_grad_norm_`` would apply to the fp32 master gradients,
        computed from the low-precision ones in fp32 and applied inside the step; otherwise Lightning's."""
        if self._clip_scale is not None:
            self._clip_scale = clip_coefficient(step_gradients(self._master_weights(), optimizer), float(clip_val))
            return
        super().clip_grad_by_norm(optimizer, clip_val)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        weights = self._master_weights()
        trainer = getattr(model, "_trainer", None)
        self._value_clipping = bool(trainer is not None and trainer.gradient_clip_val
                                    and trainer.gradient_clip_algorithm == "value")
        if self.fuses(optimizer):
            self._clip_scale = 1.0  # clip_grad_by_norm, called from the hooks, replaces it
            try:
                return _step_if_finite(self, self.guard, optimizer, model, closure, **kwargs)
            finally:
                self._clip_scale = None

        def closure_then_masters() -> Any:
            result = closure()
            weights.grads_to_masters()  # before clipping, the hooks and the finite check
            return result

        if self.scaler is None:
            return _step_if_finite(self, self.guard, optimizer, model, closure_then_masters, **kwargs)
        closure_result = closure_then_masters()
        if closure_result is None and model.automatic_optimization:
            return None  # the training step skipped backward on purpose
        self.scaler.unscale_(optimizer)  # the masters' fp32 gradients, so that clipping sees true values
        self._after_closure(model, optimizer)
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer, **kwargs)  # skipped (no refresh either) when a gradient is inf/NaN
        self.scaler.update()
        self.guard.record(self.scaler.get_scale() >= scale, model, self.precision)  # GradScaler backs off on a skip
        return closure_result

    @override
    def state_dict(self) -> dict[str, Any]:
        scaler = self.scaler.state_dict() if self.scaler is not None else {}
        return {**scaler, "guard": self.guard.state_dict(), PRECISION_KEY: self.precision}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        self.guard.load_state_dict(state.pop("guard", {}))
        state.pop(PRECISION_KEY, None)
        if state and self.scaler is not None:
            self.scaler.load_state_dict(state)


def _autocast_device(accelerator: str) -> str:
    if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def build_precision_plugin(
    precision: str,
    accelerator: str = "auto",
    *,
    fp32_regions: Mapping[str, RegionMode] | None = None,
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
    fp16_on_cpu: bool = False,
    max_consecutive_skips: int = 20,
    fused_master_step: bool = True,
) -> Precision:
    """The plugin for ``trainer.precision`` (Lightning refuses a precision string and a plugin together).

    ``auto`` and the half precisions on a CPU first become what runs fast there
    (:func:`~lit_amp_det.precision.hardware.resolve_precision`: ``32-true`` on a CPU without native bf16);
    the plugin's ``precision`` attribute is what runs. ``fused_master_step`` applies to the ``-weights`` precisions
    only (:class:`MasterWeightPrecision`).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.precision={precision!r}; choose one of {', '.join(PRECISIONS)}")
    device = _autocast_device(str(accelerator))
    precision = resolve_precision(precision, device, fp16_on_cpu)
    if precision == "32-true":
        return FiniteStepPrecision(max_consecutive_skips)
    options: dict[str, Any] = {"fp32_regions": fp32_regions, "init_scale": init_scale,
                               "growth_interval": growth_interval, "max_consecutive_skips": max_consecutive_skips}
    if precision in LOW_PRECISION_WEIGHTS:
        return MasterWeightPrecision(precision, device, fused_master_step=fused_master_step,  # type: ignore[arg-type]
                                     **options)
    return DetectionMixedPrecision(precision, device, **options)  # type: ignore[arg-type]


#: the plugins whose checkpoint state records the precision (Lightning saves it under the class's ``__qualname__``)
_RECORDING_PLUGINS = (FiniteStepPrecision, DetectionMixedPrecision, MasterWeightPrecision)


def trained_precision(checkpoint: Mapping[str, Any]) -> str | None:
    """The ``trainer.precision`` that ran when a Lightning ``checkpoint`` (the loaded dict) was saved.

    ``None`` for a checkpoint of another precision plugin, or one saved before the plugins recorded it.
    """
    for plugin in _RECORDING_PLUGINS:
        state = checkpoint.get(plugin.__qualname__)
        if isinstance(state, Mapping) and isinstance(state.get(PRECISION_KEY), str):
            return str(state[PRECISION_KEY])
    return None


def warn_if_precision_changes(checkpoint: Mapping[str, Any], source: str, running: str) -> str | None:
    """Warns when a fit resumes ``checkpoint`` (read from ``source``) in another precision than trained it.

    Resuming across precisions works (weights, optimizer and schedule carry over; fp32 master weights are the
    checkpoint's weights under ``*-weights``), but the steps that follow compute differently: typically
    ``trainer.precision=auto`` chose ``32-true`` on a CPU without native bf16 for a run started in ``bf16-mixed``
    on one with it. Returns the warning, or ``None`` when nothing changed or the checkpoint does not say.
    """
    trained = trained_precision(checkpoint)
    if trained is None or trained == running:
        return None
    message = (f"{source} was trained in {trained}; this fit continues it in {running} (the weights, optimizer "
               f"and schedule carry over, the arithmetic of the steps changes). Pass trainer.precision={trained} "
               "to continue as it was trained.")
    rank_zero_warn(message)
    return message

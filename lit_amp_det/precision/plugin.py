"""Lightning precision plugins for detection: autocast with fp32 regions, loss scaling, non-finite guard.

Plain autocast is not enough for detection: losses, box coding, proposal filtering and mask pasting lose
accuracy or overflow in half precision. :class:`DetectionMixedPrecision` extends Lightning's
``MixedPrecision`` with *fp32 regions* -- methods of the model that run with autocast disabled on fp32
inputs (or whose outputs are cast to fp32) -- installed in place on the module, so it also works under DDP,
where Lightning ignores the module ``convert_module`` returns. Both plugins skip optimizer steps whose
gradients are not finite (GradScaler does this for fp16; here bf16 and fp32 get it too), count and log the
skips, and stop with an actionable error after too many in a row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lit_amp_det.precision.casting import set_mixed_precision, wrap_method
from lit_amp_det.precision.modes import MIXED_PRECISIONS, PRECISIONS, REGION_MODES, RegionMode

__all__ = [
    "DetectionMixedPrecision",
    "FiniteStepPrecision",
    "NonFiniteStepGuard",
    "build_precision_plugin",
    "install_fp32_regions",
]

log = logging.getLogger(__name__)



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
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return True
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


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
    finite = _grads_finite(optimizer)
    guard.record(finite, model, plugin.precision)
    if not finite:
        optimizer.zero_grad(set_to_none=True)
        return closure_result
    optimizer.step(**kwargs)
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


class FiniteStepPrecision(Precision):
    """``32-true`` with the non-finite step guard (no autocast, no casting)."""

    precision = "32-true"

    def __init__(self, max_consecutive_skips: int = 20) -> None:
        super().__init__()
        self.guard = NonFiniteStepGuard(max_consecutive_skips)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        return _step_if_finite(self, self.guard, optimizer, model, closure, **kwargs)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"guard": self.guard.state_dict()}

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
        if precision not in MIXED_PRECISIONS:
            raise ValueError(
                f"trainer.precision={precision!r}; DetectionMixedPrecision takes {' or '.join(MIXED_PRECISIONS)}"
            )
        scaler = None
        if precision == "16-mixed":
            scaler = torch.amp.GradScaler(device, init_scale=init_scale, growth_interval=growth_interval)
        super().__init__(precision, device, scaler)
        self.fp32_regions = None if fp32_regions is None else dict(fp32_regions)
        self.guard = NonFiniteStepGuard(max_consecutive_skips)

    @property
    def low_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Installs the fp32 regions in place (Lightning's DDP ignores the returned module)."""
        regions = self.fp32_regions
        if regions is None:
            regions = module.fp32_regions() if hasattr(module, "fp32_regions") else {}
        install_fp32_regions(module, regions, self.low_dtype)
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

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "guard": self.guard.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        self.guard.load_state_dict(state.pop("guard", {}))
        if state:
            super().load_state_dict(state)


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
) -> Precision:
    """The plugin for ``trainer.precision`` (Lightning refuses a precision string and a plugin together)."""
    if precision == "32-true":
        return FiniteStepPrecision(max_consecutive_skips)
    if precision not in MIXED_PRECISIONS:
        raise ValueError(f"trainer.precision={precision!r}; choose one of {', '.join(PRECISIONS)}")
    device = _autocast_device(str(accelerator))
    if precision == "16-mixed" and device == "cpu" and not fp16_on_cpu:
        rank_zero_warn(
            "trainer.precision=16-mixed on a CPU runs as bf16-mixed (fp16 autocast on CPUs is slow and needs loss "
            "scaling); set precision.fp16_on_cpu=true to force fp16."
        )
        precision = "bf16-mixed"
    return DetectionMixedPrecision(
        precision,  # type: ignore[arg-type]
        device,
        fp32_regions=fp32_regions,
        init_scale=init_scale,
        growth_interval=growth_interval,
        max_consecutive_skips=max_consecutive_skips,
    )

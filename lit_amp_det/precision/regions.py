"""fp32 regions: methods of the model that run in fp32 while the rest runs in bf16/fp16, installed in place.

Plain autocast is not enough for detection: losses, box coding, proposal filtering and mask pasting lose
accuracy or overflow in half precision. A region is a method path relative to the LightningModule
(``model.rpn.compute_loss``) mapped to ``fp32`` (inputs cast to fp32, autocast off inside) or ``fp32_outputs``
(run as usual, outputs cast to fp32). The wrapping is done on the module's own objects, so it also holds under
DDP, where Lightning ignores the module a plugin's ``convert_module`` returns.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lit_amp_det.precision.casting import set_mixed_precision, wrap_method
from lit_amp_det.precision.modes import REGION_MODES, RegionMode

__all__ = ["install_fp32_regions", "regions_for"]

_PATHS_HINT = "paths are relative to the LightningModule, e.g. 'model.rpn.compute_loss'"


def install_fp32_regions(module: nn.Module, regions: Mapping[str, RegionMode], dtype: torch.dtype) -> None:
    """Marks ``module`` for mixed precision in ``dtype``, wraps each region method in place (idempotent).

    Args:
        module (nn.Module): the LightningModule (or model) the region paths start from; it and its
            submodules are marked for mixed precision.
        regions (Mapping[str, str]): method path relative to ``module`` (``"model.rpn.compute_loss"``) ->
            ``"fp32"`` or ``"fp32_outputs"``.
        dtype (torch.dtype): the low-precision dtype, ``torch.float16`` or ``torch.bfloat16``.

    Raises:
        ValueError: if ``dtype`` is not ``torch.float16`` or ``torch.bfloat16``, a mode is not ``"fp32"`` or
            ``"fp32_outputs"``, or a path does not lead to a method (a missing attribute, an owner that is
            ``None``, a name that is not callable).
    """
    set_mixed_precision(module, dtype)  # also switches on the module's own @force_fp32/@auto_fp16 methods
    for path, mode in regions.items():
        if mode not in REGION_MODES:
            raise ValueError(
                f"precision.fp32_regions[{path!r}]={mode!r}; choose one of {', '.join(REGION_MODES)}"
            )
        owner: object = (
            module  # then the object that owns the method ``path`` names, or a ValueError naming the fix
        )
        *parents, name = path.split(".")
        for part in parents:
            if not hasattr(owner, part):
                raise ValueError(
                    f"precision.fp32_regions names {path!r}, but {type(owner).__name__} has no "
                    f"attribute {part!r}; {_PATHS_HINT}"
                )
            owner = getattr(owner, part)
        if owner is None:
            raise ValueError(
                f"precision.fp32_regions names {path!r}, whose owner is None (e.g. no mask head)"
            )
        if not callable(getattr(owner, name, None)):
            raise ValueError(
                f"precision.fp32_regions names {path!r}, but {type(owner).__name__} has no method "
                f"{name!r}; {_PATHS_HINT}"
            )
        if not isinstance(owner, nn.Module):
            set_mixed_precision(owner, dtype)  # plain helpers such as torchvision's BoxCoder
        wrap_method(owner, name, mode)


def regions_for(module: nn.Module, configured: Mapping[str, RegionMode] | None) -> Mapping[str, RegionMode]:
    """The configured fp32 regions, or the module's own ``fp32_regions()`` when none are configured
    (``None``).
    """
    return (
        configured
        if configured is not None
        else module.fp32_regions()
        if hasattr(module, "fp32_regions")
        else {}
    )

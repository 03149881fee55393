"""Whether a layer computes in fp16/bf16: the condition for the layers that swap a slow half-precision oneDNN
convolution for matrix products (:mod:`~lit_amp_det.models.patch_deconv`, :mod:`~lit_amp_det.models.pointwise_conv`,
:mod:`~lit_amp_det.models.winograd_conv`), which lose to it in float32; and how their autograd Functions see the
operands autocast would give a convolution."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["HALF_DTYPES", "apply_in_autocast_dtype", "apply_with_autocast_casts", "computes_in_half", "convolution_dtype"]

#: The dtypes the matmul forms of convolutions are taken for.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def convolution_dtype(x: Tensor) -> torch.dtype:
    """The dtype a convolution fed ``x`` computes in: autocast's for ``x``'s device when autocast is on there (it
    casts a convolution's inputs to it), else ``x``'s own."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def computes_in_half(x: Tensor) -> bool:
    """True when a layer fed ``x`` computes in fp16/bf16: ``x`` is half, or autocast is on for its device with a
    half dtype (autocast casts a convolution's inputs to it)."""
    return convolution_dtype(x) in HALF_DTYPES


def apply_in_autocast_dtype(function: type[torch.autograd.Function], operands: tuple[Tensor | None, ...],
                            *args: Any) -> Tensor:
    """``function.apply(*operands, *args)``; under autocast the tensor ``operands`` (``None`` stays ``None``) are cast
    to the autocast dtype first and the Function runs with autocast off, as a convolution's or matmul's operands are
    cast (autocast does not reach into a custom Function)."""
    device = next(t for t in operands if t is not None).device.type
    if not torch.is_autocast_enabled(device):
        return function.apply(*operands, *args)
    dtype = torch.get_autocast_dtype(device)
    cast = tuple(None if t is None else t.to(dtype) for t in operands)
    with torch.autocast(device, enabled=False):
        return function.apply(*cast, *args)


def apply_with_autocast_casts(function: type[torch.autograd.Function], x: Tensor, weight: Tensor,
                              bias: Tensor | None, *args: Any) -> Tensor:
    """``function.apply(x, weight, bias, *args)`` for a convolution written as a Function, its three operands cast as
    ``F.conv2d``'s are under autocast (:func:`apply_in_autocast_dtype`)."""
    return apply_in_autocast_dtype(function, (x, weight, bias), *args)

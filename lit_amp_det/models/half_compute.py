"""Whether a layer computes in fp16/bf16: the condition for the layers that swap a slow half-precision oneDNN
convolution for matrix products (:mod:`~lit_amp_det.models.patch_deconv`, :mod:`~lit_amp_det.models.pointwise_conv`),
which lose to it in float32."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HALF_DTYPES", "computes_in_half"]

#: The dtypes the matmul forms of convolutions are taken for.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def computes_in_half(x: Tensor) -> bool:
    """True when a layer fed ``x`` computes in fp16/bf16: ``x`` is half, or autocast is on for its device with a
    half dtype (autocast casts a convolution's inputs to it)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device) in HALF_DTYPES
    return x.dtype in HALF_DTYPES

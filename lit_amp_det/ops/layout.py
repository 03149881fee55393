"""The memory layout the ops give their outputs: ATen's ``suggest_memory_format``, which Python lacks."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["suggest_memory_format"]


def suggest_memory_format(t: Tensor) -> torch.memory_format:
    """``torch.channels_last`` for a 4-D tensor laid out NHWC (and not also NCHW-contiguous), else
    ``torch.contiguous_format``: the layout ATen's kernels, and lit_amp_det's C++ kernels, give their outputs."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format

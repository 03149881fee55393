"""Memory layouts: the one the ops give their outputs (ATen's ``suggest_memory_format``, which Python lacks),
and the checks that pair tensors updated element by element in memory order (a parameter, its gradient and its
optimizer state).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["in_layout_of", "is_dense", "same_memory_order", "suggest_memory_format"]


def suggest_memory_format(t: Tensor) -> torch.memory_format:
    """``torch.channels_last`` for a 4-D tensor laid out NHWC (and not also NCHW-contiguous), else
    ``torch.contiguous_format``: the layout ATen's kernels, and lit_amp_det's C++ kernels, give their outputs.
    """
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def same_memory_order(a: Tensor, b: Tensor) -> bool:
    """Same shape and the same order in memory: the strides agree on every dimension of size > 1 (a 1x1
    convolution's weight has different strides in NCHW and channels_last for the same bytes).
    """
    return a.shape == b.shape and all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1)


def is_dense(t: Tensor) -> bool:
    """Its elements fill one block of memory without gaps or overlaps, in any dimension order."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def in_layout_of(param: Tensor, value: Tensor) -> Tensor:
    """``value`` (``param``'s shape, any dtype) in ``param``'s memory order: ``value`` itself when it already
    is (and dense), else a copy.
    """
    if same_memory_order(param, value) and is_dense(value):
        return value
    return torch.empty_like(param, dtype=value.dtype).copy_(value)

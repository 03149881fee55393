"""The memory-order alignment PyTorch's fused optimizer kernels need, so that a step never updates the wrong
elements.

PyTorch's fused kernels (``torch.optim.SGD/Adam/AdamW(fused=True)``) walk a parameter, its gradient and its
state (momentum buffer, Adam's moments) as flat arrays in memory order and trust the three to agree. After
resuming a checkpoint whose optimizer state was saved in another layout (a ``channels_last`` run resumed
without it, or the reverse), they do not, and the update lands on the wrong elements, silently.
:func:`align_with_params`, run before every fused step by :func:`~lit_amp_det.optim.build_optimizer`, lays out
whatever differs; it copies nothing when the layouts already agree (every step after the first).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lit_amp_det.ops.layout import in_layout_of, same_memory_order

__all__ = ["align_before_fused_step", "align_with_params"]


def align_with_params(optimizer: torch.optim.Optimizer) -> int:
    """Lays every gradient and every parameter-shaped state tensor (momentum buffers, Adam's moments) out in
    its parameter's memory order, copying only those that differ.

    Why: fused kernels trust the three layouts to agree (see the module docstring); they disagree after
    resuming optimizer state saved in another layout, or with a gradient set by hand.

    Args:
        optimizer: the optimizer whose parameters' gradients and state are aligned in place.

    Returns:
        How many tensors were copied.
    """
    copied = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            strides = param.stride()
            grad = param.grad
            if (
                grad is not None and not grad.is_sparse and grad.stride() != strides
            ):  # equal strides: the fast path
                aligned = in_layout_of(param, grad)
                if aligned is not grad:
                    param.grad = aligned
                    copied += 1
            state = optimizer.state.get(param, {})
            # the state tensors of the parameter's shape: those updated element by element with it
            for key in [k for k, v in state.items() if isinstance(v, Tensor) and v.shape == param.shape]:
                value = state[key]
                if not value.is_sparse and value.stride() != strides and not same_memory_order(param, value):
                    state[key] = in_layout_of(param, value)
                    copied += 1
    return copied


def align_before_fused_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook of the fused optimizers :func:`~lit_amp_det.optim.build_optimizer` makes:
    :func:`align_with_params`.
    """
    align_with_params(optimizer)

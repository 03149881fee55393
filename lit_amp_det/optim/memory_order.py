"""Fused optimizer steps over tensors whose memory orders agree: the alignment they need, and a copy they skip.

PyTorch's fused CPU kernels (``torch.optim.SGD/Adam/AdamW(fused=True)``, torch 2.14.1) update a parameter element
by element in memory order: the parameter, its gradient and its state (momentum buffer, Adam's moments) are walked
as flat arrays. Two things follow.

* The tensors must share one memory order, or the update lands on the wrong elements, silently.
  :func:`align_with_params` lays out whatever differs (a state saved in another layout and resumed).
* Before that walk, each kernel makes the gradient ``contiguous()``, and then reads the original gradient
  instead: for a channels_last convolution weight that is one full copy per step, thrown away (measured with
  the profiler: the copy takes as long as the update itself). :class:`SGD`, :class:`Adam` and :class:`AdamW`
  run torch's own step, after the closure, with every dense parameter, its gradient and its state seen through
  contiguous strides over the same memory (:func:`memory_order_views`). The kernel then walks the same elements
  in the same order, so the update is bit for bit torch's, without the copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lit_amp_det.ops.layout import in_layout_of, is_dense, same_memory_order

__all__ = ["MEMORY_ORDER_STEPS", "SGD", "Adam", "AdamW", "align_before_fused_step", "align_with_params",
           "memory_order_views"]


def align_with_params(optimizer: torch.optim.Optimizer) -> int:
    """Lays every gradient and every parameter-shaped state tensor (momentum buffers, Adam's moments) out in its
    parameter's memory order, copying only those that differ; returns how many it copied.

    Why: PyTorch's fused CPU kernels (``torch.optim.SGD(fused=True)``, measured on torch 2.14.1) walk a parameter,
    its gradient and its momentum buffer in memory order and trust them to agree. When they do not, the update
    lands on the wrong elements, silently. They disagree after resuming a checkpoint whose optimizer state was
    saved in another layout, e.g. a ``model.channels_last=false`` run resumed with ``model.channels_last=true``:
    ``Optimizer.load_state_dict`` keeps the saved momentum buffers NCHW under channels_last weights. (Autograd
    already gives a parameter's gradient its layout; a gradient set by hand may not have it.)
    """
    copied = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            strides = param.stride()
            grad = param.grad
            if grad is not None and not grad.is_sparse and grad.stride() != strides:  # equal strides: the fast path
                aligned = in_layout_of(param, grad)
                if aligned is not grad:
                    param.grad = aligned
                    copied += 1
            state = optimizer.state.get(param, {})
            for key in _state_tensors(state, param):
                value = state[key]
                if not value.is_sparse and value.stride() != strides and not same_memory_order(param, value):
                    state[key] = in_layout_of(param, value)
                    copied += 1
    return copied


def align_before_fused_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook of the fused optimizers :func:`~lit_amp_det.optim.build_optimizer` makes with torch's own
    classes (the memory-order ones align inside their step): :func:`align_with_params`."""
    align_with_params(optimizer)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _state_tensors(state: dict[str, Any], param: Tensor) -> list[str]:
    """The keys of ``state`` holding tensors of ``param``'s shape (those updated element by element with it)."""
    return [key for key, value in state.items() if isinstance(value, Tensor) and value.shape == param.shape]


def _viewable_state(param: Tensor, state: dict[str, Any]) -> list[str] | None:
    """The keys of ``param``'s state tensors when ``param`` is dense but not contiguous (channels_last), on the
    CPU, and its gradient and those state tensors are dense in its memory order (flat-strided views of all of them
    pair the same elements); None otherwise."""
    grad = param.grad
    if grad is None or param.device.type != "cpu" or param.is_contiguous() or not is_dense(param):
        return None
    keys = _state_tensors(state, param)
    tensors = [grad, *(state[key] for key in keys)]
    return keys if all(not t.is_sparse and is_dense(t) and same_memory_order(param, t) for t in tensors) else None


@contextmanager
def memory_order_views(optimizer: torch.optim.Optimizer) -> Iterator[int]:
    """Within: every dense, non-contiguous CPU parameter with a gradient, that gradient and the parameter-shaped
    state are seen with contiguous strides over their own memory (``as_strided``, no copy); yields how many
    parameters. On exit, also after an error, the parameters and gradients are the tensors they were, and the
    state tensors (those made during the block too) get the parameters' strides back.

    Inside, a tensor's element ``[i, j, k, l]`` is its memory's ``i*C*H*W + j*H*W + k*W + l``-th element, not the
    model's ``[i, j, k, l]``: only an element-wise update that pairs the parameter, gradient and state element by
    element may run there (torch's fused SGD/Adam/AdamW), never a forward pass or a hook.
    """
    viewed: list[tuple[Tensor, Tensor, Tensor, tuple[int, ...]]] = []
    try:
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                keys = _viewable_state(param, state)
                if keys is None:
                    continue
                flat = _contiguous_strides(param.shape)
                real, grad = param.data, param.grad
                viewed.append((param, real, grad, real.stride()))
                param.data = real.as_strided(real.shape, flat)
                param.grad = grad.as_strided(grad.shape, flat)
                for key in keys:
                    state[key] = state[key].as_strided(param.shape, flat)
        yield len(viewed)
    finally:
        for param, real, grad, strides in viewed:
            flat = param.stride()
            param.data = real
            param.grad = grad
            state = optimizer.state.get(param, {})
            for key in _state_tensors(state, param):
                if state[key].stride() == flat:
                    state[key] = state[key].as_strided(param.shape, strides)


class _MemoryOrderStep:
    """Mixin for a torch optimizer whose fused step is element-wise: the closure first, then
    :func:`align_with_params`, then the class's own step, under :func:`memory_order_views` when ``fused``.

    The base step is called without torch's hook wrapper: the step hooks run around this step, outside the
    views, where parameters are what the model sees. ``update_of`` names the torch class whose update this is
    (the bf16-weights mode's fused master step accepts the SGD one as ``torch.optim.SGD``).
    """

    update_of: type[torch.optim.Optimizer]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Runs ``closure`` (with grad enabled) if given, then the update; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        base_step = _unhooked(self.update_of.step)
        if not self.defaults.get("fused"):
            base_step(self)
            return loss
        align_with_params(self)
        with memory_order_views(self):
            base_step(self)
        return loss


def _unhooked(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` without the step-hook wrapper ``torch.optim.Optimizer`` puts on a class once an instance exists
    (marked ``hooked``); the other decorators (no_grad, differentiable) stay."""
    return step.__wrapped__ if getattr(step, "hooked", False) else step


class SGD(_MemoryOrderStep, torch.optim.SGD):
    """``torch.optim.SGD``, with its fused CPU step skipping PyTorch's per-step copy of channels_last gradients
    (:func:`memory_order_views`); the same update, bit for bit."""

    update_of = torch.optim.SGD


class Adam(_MemoryOrderStep, torch.optim.Adam):
    """``torch.optim.Adam``, with its fused CPU step skipping PyTorch's per-step copy of channels_last gradients
    (:func:`memory_order_views`); the same update, bit for bit."""

    update_of = torch.optim.Adam


class AdamW(_MemoryOrderStep, torch.optim.AdamW):
    """``torch.optim.AdamW``, with its fused CPU step skipping PyTorch's per-step copy of channels_last gradients
    (:func:`memory_order_views`); the same update, bit for bit."""

    update_of = torch.optim.AdamW


#: torch optimizer class -> the subclass :func:`~lit_amp_det.optim.build_optimizer` builds for it
MEMORY_ORDER_STEPS: dict[type[torch.optim.Optimizer], type[torch.optim.Optimizer]] = {
    torch.optim.SGD: SGD, torch.optim.Adam: Adam, torch.optim.AdamW: AdamW}

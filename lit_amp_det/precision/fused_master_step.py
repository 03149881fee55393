"""The SGD step of the low-precision-weights mode in one pass: bf16 gradient in, fp32 master and bf16 weight out.

:class:`~lit_amp_det.precision.master_weights.MasterWeights` steps any optimizer through hooks: the bf16
gradients are copied into fp32 master gradients, the optimizer updates the masters, the bf16 weights are copied
from them. For ``torch.optim.SGD`` this module does the same update with :func:`lit_amp_det.ops.master_sgd_step_`,
which reads each bf16 gradient once and writes master, momentum and weight in the same pass: no fp32 gradient is
kept, and a parameter costs 20 bytes of memory traffic instead of 32 (measured: BENCHMARKS.md). The optimizer's
state is ``torch.optim.SGD``'s own (``state[master]["momentum_buffer"]``), so checkpoints, resuming, schedulers
and a later unfused step all see an ordinary SGD. Masters are given their weights' memory order (channels_last
for convolution weights) on the first step, so that the kernel walks the four tensors of a parameter in step.

:class:`~lit_amp_det.precision.plugin.MasterWeightPrecision` uses it when ``precision.fused_master_step`` is on
and :func:`unfused_reason` finds nothing against it; the plugin also computes gradient-norm clipping from the
bf16 gradients (in fp32) and passes the coefficient in as ``grad_scale``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from lit_amp_det.ops._extension import extension_available
from lit_amp_det.ops.layout import in_layout_of, same_memory_order
from lit_amp_det.ops.optim_step import all_finite, master_sgd_step_
from lit_amp_det.precision.master_weights import MasterWeights

__all__ = [
    "clip_coefficient",
    "fused_master_sgd_step",
    "gradients_finite",
    "release_low_gradients",
    "step_gradients",
    "unfused_reason",
]


def unfused_reason(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot take the fused step (None: it can).

    Only ``torch.optim.SGD`` itself (a subclass may change ``step``) or a subclass whose ``update_of`` says its
    update is that of ``torch.optim.SGD`` (``lit_amp_det.optim.SGD``), with float32 parameters (masters, and the
    norms' own fp32 parameters), dense gradients and ``differentiable=False``, on the CPU with the compiled
    kernel: there is no CUDA kernel yet, and the plain-PyTorch reference (several passes) would be slower there
    than torch's own fused SGD behind the hooks.
    """
    if getattr(type(optimizer), "update_of", type(optimizer)) is not torch.optim.SGD:
        return f"{type(optimizer).__name__} is not torch.optim.SGD"
    if not extension_available():
        return "the compiled extension lit_amp_det._C is not built"
    for index, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            return f"param_groups[{index}] has differentiable=True"
        for param in group["params"]:
            if param.dtype != torch.float32:
                return f"param_groups[{index}] holds a {param.dtype} parameter"
            if param.device.type != "cpu":
                return f"param_groups[{index}] holds a parameter on {param.device} (the kernel is CPU-only so far)"
    return None


def _lows_by_master(weights: MasterWeights) -> dict[int, nn.Parameter]:
    return {id(master): low for low, master in weights.pairs()}


def _pairs_with_grads(weights: MasterWeights, optimizer: torch.optim.Optimizer,
                      ) -> Iterator[tuple[int, nn.Parameter, nn.Parameter | None, Tensor]]:
    """``(group index, optimizer parameter, its low-precision weight or None, the gradient the step reads)``."""
    lows = _lows_by_master(weights)
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            low = lows.get(id(param))
            grad = low.grad if low is not None else param.grad
            if grad is not None:
                yield index, param, low, grad


def step_gradients(weights: MasterWeights, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The gradients a fused step reads: each master's bf16/fp16 weight gradient, other parameters' own."""
    return [grad for _, _, _, grad in _pairs_with_grads(weights, optimizer)]


def gradients_finite(weights: MasterWeights, optimizer: torch.optim.Optimizer) -> bool:
    """No gradient of the coming fused step is inf or NaN (one read of each, :func:`lit_amp_det.ops.all_finite`)."""
    return all_finite(step_gradients(weights, optimizer))


@torch.no_grad()
def fused_master_sgd_step(weights: MasterWeights, optimizer: torch.optim.SGD, grad_scale: float = 1.0) -> None:
    """One step of ``optimizer`` (a ``torch.optim.SGD`` attached to ``weights``) straight from the low-precision
    gradients; the low-precision weights are written from the new masters and their gradients released.

    Parameters of the optimizer without a master (the norms' fp32 parameters) step from their own gradients.
    ``grad_scale`` multiplies every gradient first (a gradient-clipping coefficient). Each group's
    hyperparameters (``lr`` as the scheduler left it, momentum, dampening, weight decay, nesterov, maximize)
    are read at the call.
    """
    buckets: dict[tuple[int, bool, bool], list[list[Tensor]]] = defaultdict(lambda: [[], [], [], []])
    for index, param, low, grad in _pairs_with_grads(weights, optimizer):
        if grad.is_sparse:
            raise RuntimeError("the fused master step does not take sparse gradients; set "
                               "precision.fused_master_step=false")
        if low is not None and not same_memory_order(param, low):  # first step: the master takes its weight's order
            param.data = torch.empty_like(low, dtype=torch.float32).copy_(param.data)
        momentum = optimizer.param_groups[index]["momentum"]
        first = False
        buffer = None
        if momentum != 0:
            state = optimizer.state[param]
            buffer = state.get("momentum_buffer")
            first = buffer is None
            buffer = state["momentum_buffer"] = torch.empty_like(param) if first else in_layout_of(param, buffer)
        lists = buckets[(index, first, low is not None)]
        lists[0].append(param)
        lists[1].append(in_layout_of(param, grad))
        if buffer is not None:
            lists[2].append(buffer)
        if low is not None:
            lists[3].append(low)
    for (index, first, _), (params, grads, buffers, lows) in buckets.items():
        group = optimizer.param_groups[index]
        master_sgd_step_(params, grads, buffers, lows, lr=float(group["lr"]), momentum=group["momentum"],
                         dampening=group["dampening"], weight_decay=group["weight_decay"],
                         nesterov=group["nesterov"], maximize=group["maximize"], grad_scale=grad_scale,
                         first_step=first)
    release_low_gradients(weights)


def release_low_gradients(weights: MasterWeights) -> None:
    """Drops the low-precision weights' gradients (after a fused step consumed them, or a skipped one)."""
    for low in weights.params:
        low.grad = None


def clip_coefficient(grads: list[Tensor], max_norm: float, norm_type: float = 2.0) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient ``min(1, max_norm / (total_norm + 1e-6))`` for ``grads``,
    with every norm computed in fp32 (so bf16 gradients are clipped as their fp32 master copies would be)."""
    if not grads:
        return 1.0
    norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    return float(torch.clamp(max_norm / (total + 1e-6), max=1.0))

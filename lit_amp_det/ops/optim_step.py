"""The optimizer step of the low-precision-weights mode as one pass over memory, and a one-read finite check.

``trainer.precision=bf16-weights`` trains bf16 weights whose updates accumulate in fp32 masters. Stepping them
with ``torch.optim.SGD`` takes three passes over every parameter: the bf16 gradient is copied into an fp32
master gradient, the SGD kernel updates the master and its momentum, and the master is copied back into the bf16
weight (32 bytes moved per parameter, plus an fp32 gradient kept per parameter). :func:`master_sgd_step_` reads
the bf16 gradient as it is and writes master, momentum and weight in the same pass (20 bytes per parameter, no
fp32 gradient). :func:`all_finite` is the step's non-finite check in one read of the gradients (``isfinite(g)
.all()`` writes a bool tensor per gradient first).

Both run the C++ CPU kernel of ``lit_amp_det._C``; elsewhere (CUDA, or without the compiled extension) their
:mod:`lit_amp_det.ops.reference` implementation, in plain PyTorch (foreach ops), with the same results.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lit_amp_det.ops import reference
from lit_amp_det.ops._extension import extension_available

__all__ = ["all_finite", "master_sgd_step_"]


def _compiled_on(tensors: Sequence[Tensor]) -> bool:
    """The compiled CPU kernel applies (the CUDA key has no kernel for these ops yet: the reference runs there)."""
    return extension_available() and all(t.device.type == "cpu" for t in tensors)


def master_sgd_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    low_weights: Sequence[Tensor] = (),
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    grad_scale: float = 1.0,
    first_step: bool = False,
) -> None:
    """One ``torch.optim.SGD`` step of fp32 ``params`` from gradients of any float dtype, in place.

    Per element, in fp32: ``g = grad * grad_scale`` (negated when ``maximize``), ``g += weight_decay * param``,
    ``buf = g`` on the ``first_step`` else ``buf = momentum * buf + (1 - dampening) * g``, ``g = g + momentum *
    buf`` (``nesterov``) or ``buf``, ``param -= lr * g``; then ``low_weights[i] = param`` rounded to their dtype.
    ``torch.optim.SGD`` 's arithmetic; its own kernels may fuse a multiply-add, so the two agree to an ulp.

    Args:
        params: fp32 tensors (the masters), dense (contiguous or channels_last).
        grads: one per param, float32/bfloat16/float16, with the param's shape and strides.
        momentum_buffers: one fp32 tensor per param with its strides (empty when ``momentum`` is 0); written.
        low_weights: empty, or one bfloat16/float16 tensor per param with its strides; written.
        grad_scale: multiplies every gradient first (a clipping coefficient, or 1 / a loss scale).
        first_step: the momentum buffers hold nothing yet (``torch.optim.SGD``'s first step copies the gradient).
    """
    if not params:
        return
    args = (list(params), list(grads), list(momentum_buffers), list(low_weights), float(lr), float(momentum),
            float(dampening), float(weight_decay), bool(nesterov), bool(maximize), float(grad_scale),
            bool(first_step))
    if _compiled_on([*params, *grads, *momentum_buffers, *low_weights]):
        torch.ops.lit_amp_det.master_sgd_step_(*args)
    else:
        reference.master_sgd_step_(*args)


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether no element of any tensor is inf or NaN (integer tensors count as finite; empty input: True)."""
    if not tensors:
        return True
    if _compiled_on(tensors):
        return bool(torch.ops.lit_amp_det.all_finite(list(tensors)))
    return bool(reference.all_finite(tensors))


if extension_available():

    @torch.library.register_fake("lit_amp_det::master_sgd_step_")
    def _master_sgd_step_fake(params, grads, momentum_buffers, low_weights, lr, momentum, dampening, weight_decay,
                              nesterov, maximize, grad_scale, first_step) -> None:
        return None

    @torch.library.register_fake("lit_amp_det::all_finite")
    def _all_finite_fake(tensors) -> Tensor:
        device = tensors[0].device if tensors else torch.device("cpu")
        return torch.empty((), dtype=torch.bool, device=device)

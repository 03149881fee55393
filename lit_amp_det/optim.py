"""Optimizer and learning-rate schedule builders for detection training.

Detection recipes warm the learning rate up linearly for a few hundred steps (large early gradients from
randomly initialised heads otherwise blow up the RPN) and then either drop it at fixed points
(multistep, the Detectron/MMDetection "1x" schedule) or anneal it (cosine). Milestones may be given
as fractions of the run so one config serves any run length. Schedules step per optimizer step.

Recipes quote their learning rate for a global batch (torchvision's Mask R-CNN: 0.02 for 16 images); with
``optim.reference_batch`` set, :func:`scale_lr` applies the linear scaling rule (Goyal et al., 2017: lr
proportional to the global batch), so one config serves 1 GPU and 8 GPUs alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from hydra.utils import instantiate
from torch.optim.lr_scheduler import LambdaLR

from lit_amp_det.errors import ArgumentError
from lit_amp_det.ops.layout import in_layout_of, same_memory_order

__all__ = ["align_with_params", "build_optimizer", "warmup_schedule", "fused_available", "check_reference_batch",
           "global_batch_size", "scale_lr"]


def fused_available(params: Iterable[torch.Tensor]) -> bool:
    """True when every parameter lives on a device with fused optimizer kernels (CUDA, and CPU since 2.4)."""
    devices = {p.device.type for p in params}
    return bool(devices) and devices <= {"cuda", "cpu"}


def build_optimizer(config: Mapping[str, Any], params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Instantiates ``config`` (a ``_target_`` mapping such as ``torch.optim.SGD``) for ``params``.

    ``fused: auto`` picks the fused single-kernel implementation wherever every parameter's device has
    one; ``fused: null`` leaves the choice to PyTorch (``foreach``). A fused optimizer gets a step pre-hook that
    gives the gradients and the state its parameters' memory order first (:func:`align_with_params`), which
    PyTorch's fused kernels assume.
    """
    if "_target_" not in config:
        raise ArgumentError("optimizer", dict(config), "needs a _target_ (e.g. torch.optim.SGD)")
    options = dict(config)
    if options.get("fused") == "auto":
        options["fused"] = fused_available(params)
    if options.get("fused") is None:
        options.pop("fused", None)
    optimizer = instantiate(options, params=list(params))
    if options.get("fused"):
        optimizer.register_step_pre_hook(_align_before_fused_step)
    return optimizer


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
            state = optimizer.state.get(param)
            for key, value in (state or {}).items():
                if (isinstance(value, torch.Tensor) and not value.is_sparse and value.shape == param.shape
                        and value.stride() != strides and not same_memory_order(param, value)):
                    state[key] = in_layout_of(param, value)
                    copied += 1
    return copied


def _align_before_fused_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook of the fused optimizers :func:`build_optimizer` makes: :func:`align_with_params`."""
    align_with_params(optimizer)


def global_batch_size(per_device: int | None, world_size: int, accumulate_grad_batches: int) -> int:
    """Images per optimizer step: ``per_device`` x processes (devices x nodes) x accumulated batches.

    ``per_device`` is the data module's ``batch_size``; ``None`` (a data module without one, or loaders passed to
    the Trainer directly) is an error, since the lr scaling cannot be computed without it.
    """
    if per_device is None:
        raise ValueError(
            "optim.reference_batch is set, so the lr is scaled to the global batch, but the per-device batch size is "
            "unknown: the Trainer has no data module with a batch_size attribute. Fit with a data module that has "
            "one, or set optim.reference_batch=null and give the lr for your batch"
        )
    for name, value in (("data.batch_size", per_device), ("world size", world_size),
                        ("trainer.accumulate_grad_batches", accumulate_grad_batches)):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1 to compute the global batch, got {value}")
    return int(per_device) * int(world_size) * int(accumulate_grad_batches)


def check_reference_batch(reference_batch: Any) -> None:
    """``reference_batch`` is ``None`` or a positive integer."""
    if reference_batch is None:
        return
    if isinstance(reference_batch, bool) or not isinstance(reference_batch, int) or reference_batch < 1:
        raise ArgumentError("reference_batch", reference_batch, "must be a positive integer (the global batch the "
                            "lr is given for, e.g. 16), or null to use the lr as it is")


def scale_lr(config: Mapping[str, Any], global_batch: int, reference_batch: int) -> dict[str, Any]:
    """A copy of the optimizer ``config`` with ``lr`` scaled by ``global_batch / reference_batch``.

    ``reference_batch`` is the global batch the configured lr is meant for (``optim.reference_batch``).
    """
    check_reference_batch(reference_batch)
    if "lr" not in config:
        raise ValueError(f"optim.reference_batch={reference_batch} scales optimizer.lr, but the optimizer config "
                         f"has no lr (keys {sorted(config)}); set optim.optimizer.lr")
    return {**config, "lr": float(config["lr"]) * global_batch / reference_batch}


def warmup_schedule(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    warmup_steps: int | float = 100,
    warmup_factor: float = 0.001,
    policy: Literal["multistep", "cosine", "constant"] = "multistep",
    milestones: Sequence[float] = (0.75, 0.92),
    gamma: float = 0.1,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """Linear warm-up followed by a multistep, cosine or constant schedule.

    Args:
        total_steps: optimizer steps in the whole run (Lightning's ``estimated_stepping_batches``).
        warmup_steps: steps of linear warm-up from ``warmup_factor * lr`` to ``lr``; a value below 1
            is a fraction of ``total_steps``.
        milestones: multistep drop points, in steps, or as fractions of ``total_steps`` when all are <= 1.
        gamma: multistep decay per milestone.
        min_lr_ratio: cosine floor as a fraction of the base lr.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if policy not in ("multistep", "cosine", "constant"):
        raise ValueError(f"scheduler policy={policy!r}; choose multistep, cosine or constant")
    warmup = int(round(warmup_steps * total_steps)) if 0 < warmup_steps < 1 else int(warmup_steps)
    as_fraction = all(0 < m <= 1 for m in milestones)
    steps = sorted(int(round(m * total_steps)) if as_fraction else int(m) for m in milestones)

    def factor(step: int) -> float:
        scale = 1.0
        if step < warmup:
            alpha = step / warmup
            scale = warmup_factor * (1 - alpha) + alpha
        if policy == "multistep":
            return scale * gamma ** sum(step >= m for m in steps)
        if policy == "cosine":
            progress = min(step / total_steps, 1.0)
            return scale * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
        return scale

    return LambdaLR(optimizer, factor)

"""Optimizers from a Hydra config: the fused kernels where the device has them, and the lr scaled to the
global batch.

Recipes quote their learning rate for a global batch (torchvision's Mask R-CNN: 0.02 for 16 images); with
``optim.reference_batch`` set, :func:`scale_lr` applies the linear scaling rule (Goyal et al., 2017: lr
proportional to the global batch), so one config serves 1 GPU and 8 GPUs alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from hydra.utils import instantiate

from lit_amp_det.errors import ArgumentError
from lit_amp_det.optim.memory_order import align_before_fused_step

__all__ = ["build_optimizer", "check_reference_batch", "fused_available", "global_batch_size", "scale_lr"]


def fused_available(params: Iterable[torch.Tensor]) -> bool:
    """Whether every parameter lives on a device with fused optimizer kernels (CUDA, and CPU since 2.4).

    Args:
        params: the parameters an optimizer will step.

    Returns:
        ``True`` when there is at least one and all are on such a device.
    """
    devices = {p.device.type for p in params}
    return bool(devices) and devices <= {"cuda", "cpu"}


def build_optimizer(config: Mapping[str, Any], params: Sequence[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Instantiates ``config`` (a ``_target_`` mapping such as ``torch.optim.SGD``) for ``params``.

    ``fused: auto`` (read here, not passed on) picks the fused single-kernel implementation wherever every
    parameter's device has one; ``fused: null`` leaves the choice to PyTorch (``foreach``). A fused optimizer
    gets a step pre-hook that gives the gradients and the state their parameters' memory order first
    (:func:`~lit_amp_det.optim.memory_order.align_with_params`), which PyTorch's fused kernels assume.

    Args:
        config: the ``optim.optimizer`` mapping: ``_target_`` and the optimizer's keywords.
        params: the parameters to optimise.

    Returns:
        The optimizer.

    Raises:
        ArgumentError: ``config`` has no ``_target_``.
    """
    if "_target_" not in config:
        raise ArgumentError("optimizer", dict(config), "needs a _target_ (e.g. torch.optim.SGD)")
    options = dict(config)
    params = list(params)
    if options.get("fused") == "auto":
        options["fused"] = fused_available(params)
    if options.get("fused") is None:
        options.pop("fused", None)
    optimizer = instantiate(options, params=params)
    if options.get("fused"):
        optimizer.register_step_pre_hook(align_before_fused_step)
    return optimizer


def global_batch_size(per_device: int | None, world_size: int, accumulate_grad_batches: int) -> int:
    """Images per optimizer step: ``per_device`` x processes (devices x nodes) x accumulated batches.

    Args:
        per_device: the data module's ``batch_size``; ``None`` (a data module without one, or loaders passed
            to the Trainer directly) is an error, since the lr scaling cannot be computed without it.
        world_size: processes (devices x nodes).
        accumulate_grad_batches: ``trainer.accumulate_grad_batches``.

    Returns:
        The global batch.

    Raises:
        ValueError: ``per_device`` is unknown or a factor is below 1, naming the setting.
    """
    if per_device is None:
        raise ValueError(
            "optim.reference_batch is set, so the lr is scaled to the global batch, but the per-device "
            "batch size is unknown: the Trainer has no data module with a batch_size attribute. Fit with "
            "a data module that has one, or set optim.reference_batch=null and give the lr for your batch"
        )
    for name, value in (
        ("data.batch_size", per_device),
        ("world size", world_size),
        ("trainer.accumulate_grad_batches", accumulate_grad_batches),
    ):
        if int(value) < 1:
            raise ValueError(f"{name} must be >= 1 to compute the global batch, got {value}")
    return int(per_device) * int(world_size) * int(accumulate_grad_batches)


def check_reference_batch(reference_batch: Any) -> None:
    """Checks ``optim.reference_batch``.

    Args:
        reference_batch: the global batch the lr is given for, or ``None``.

    Raises:
        ArgumentError: ``reference_batch`` is neither ``None`` nor a positive integer.
    """
    if reference_batch is None:
        return
    if isinstance(reference_batch, bool) or not isinstance(reference_batch, int) or reference_batch < 1:
        raise ArgumentError(
            "reference_batch",
            reference_batch,
            "must be a positive integer (the global batch the "
            "lr is given for, e.g. 16), or null to use the lr as it is",
        )


def scale_lr(config: Mapping[str, Any], global_batch: int, reference_batch: int) -> dict[str, Any]:
    """A copy of the optimizer ``config`` with ``lr`` scaled by ``global_batch / reference_batch``.

    Args:
        config: the ``optim.optimizer`` mapping.
        global_batch: the run's images per optimizer step (:func:`global_batch_size`).
        reference_batch: the global batch the configured lr is meant for (``optim.reference_batch``).

    Returns:
        The mapping with the scaled ``lr``.

    Raises:
        ArgumentError: a bad ``reference_batch``.
        ValueError: ``config`` has no ``lr``.
    """
    check_reference_batch(reference_batch)
    if "lr" not in config:
        raise ValueError(
            f"optim.reference_batch={reference_batch} scales optimizer.lr, but the optimizer config "
            f"has no lr (keys {sorted(config)}); set optim.optimizer.lr"
        )
    return {**config, "lr": float(config["lr"]) * global_batch / reference_batch}

"""The learning-rate schedule of detection recipes: a linear warm-up, then multistep drops or cosine
annealing.

Detection recipes warm the learning rate up linearly for a few hundred steps (large early gradients from
randomly initialised heads otherwise blow up the RPN) and then either drop it at fixed points
(multistep, the Detectron/MMDetection "1x" schedule) or anneal it (cosine). Milestones may be given
as fractions of the run so one config serves any run length. Schedules step per optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["warmup_schedule"]


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
        optimizer: the optimizer whose lr is scheduled.
        total_steps: optimizer steps in the whole run (Lightning's ``estimated_stepping_batches``).
        warmup_steps: steps of linear warm-up from ``warmup_factor * lr`` to ``lr``; a value below 1
            is a fraction of ``total_steps``.
        milestones: multistep drop points, in steps, or as fractions of ``total_steps`` when all are <= 1.
        gamma: multistep decay per milestone.
        warmup_factor: the lr at the first step, as a fraction of ``lr``.
        policy: after the warm-up, ``multistep`` (drops by ``gamma`` at ``milestones``), ``cosine`` (to
            ``min_lr_ratio``) or ``constant``.
        min_lr_ratio: cosine floor as a fraction of the base lr.

    Returns:
        A step-wise ``LambdaLR``.

    Raises:
        ValueError: ``total_steps`` below 1 or an unknown ``policy``.
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

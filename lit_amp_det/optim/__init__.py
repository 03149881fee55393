"""Optimizers and learning-rate schedules for detection training.

* :mod:`~lit_amp_det.optim.build`: optimizers from a Hydra config (``fused: auto``), the lr scaled to the
  global batch.
* :mod:`~lit_amp_det.optim.schedule`: the warm-up + multistep/cosine schedule.
* :mod:`~lit_amp_det.optim.memory_order`: the memory-order alignment PyTorch's fused kernels need.
"""

from lit_amp_det.optim.build import (
    build_optimizer,
    check_reference_batch,
    fused_available,
    global_batch_size,
    scale_lr,
)
from lit_amp_det.optim.memory_order import align_with_params
from lit_amp_det.optim.schedule import warmup_schedule

__all__ = [
    "align_with_params",
    "build_optimizer",
    "check_reference_batch",
    "fused_available",
    "global_batch_size",
    "scale_lr",
    "warmup_schedule",
]

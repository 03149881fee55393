"""Model-wide speed switches: channels_last memory format and ``torch.compile`` of the backbone.

Both act in place on a built detector, keep every ``state_dict`` key and shape (checkpoints load either
way), and are configured by ``model.channels_last`` and ``model.compile``:

* **channels_last** (NHWC): cuDNN's tensor-core convolutions and lit_amp_det's RoIAlign read NHWC without
  transposes, so under mixed precision on a GPU the backbone, FPN and heads skip the NCHW<->NHWC copies
  cuDNN otherwise makes around every convolution. The 4-D weights are converted, and the batched image
  tensor is made channels_last before the backbone (torchvision's transform builds it NCHW); convolutions
  then propagate the format through the FPN and the RoI heads.
* **compile** ``"backbone"``: ``torch.compile`` on the ResNet+FPN only. It is the part with static shapes
  (images are padded to ``size_divisible``), so it compiles once per input size; the RPN and RoI heads have
  data-dependent shapes (proposal counts) that would recompile or graph-break every step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["COMPILE_TARGETS", "use_channels_last", "compile_detector"]

#: Values of ``model.compile``.
COMPILE_TARGETS = (None, "backbone")


def _to_channels_last(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    images, *rest = args
    if isinstance(images, Tensor) and images.dim() == 4:
        images = images.contiguous(memory_format=torch.channels_last)
    return (images, *rest)


def use_channels_last(detector: nn.Module) -> nn.Module:
    """Converts the detector's 4-D weights to channels_last and feeds its backbone channels_last images."""
    if not hasattr(detector, "backbone"):
        raise TypeError(f"model.channels_last=true needs a detector with a .backbone, got {type(detector).__name__}")
    detector.to(memory_format=torch.channels_last)
    detector.backbone.register_forward_pre_hook(_to_channels_last)
    return detector


def compile_detector(detector: nn.Module, target: str | None, **compile_options: Any) -> nn.Module:
    """Compiles ``target`` of the detector in place (``nn.Module.compile``: parameter names are unchanged)."""
    if target not in COMPILE_TARGETS:
        raise ValueError(f"model.compile={target!r}; choose one of {list(COMPILE_TARGETS)} (null: eager)")
    if target == "backbone":
        detector.backbone.compile(**compile_options)
    return detector

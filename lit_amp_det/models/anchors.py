"""Anchors computed in fp32 whatever the feature maps' dtype.

torchvision's ``AnchorGenerator`` builds the anchors in the dtype of the feature maps it is given. Under
autocast (or with half-precision weights) those are bf16/fp16, so the anchor coordinates are rounded to the
half format. bf16 keeps 8 significant bits, so above 1024 the shift and the shifted corner are each rounded to
a multiple of 8, and anchors on a full-size image are pixels off before the fp32 box decoding sees them.
``set_cell_anchors`` also converts the generator's cell anchors *in place*, so after one bf16 step a cell
anchor that is not a bf16 number stays rounded in later fp32 calls, evaluation included.

:class:`FullPrecisionAnchorGenerator` hands torchvision's code a zero-stride fp32 stand-in of each half
feature map (the generator reads only its shape, dtype and device; nothing is allocated), so the anchors and
the cell anchors stay fp32. fp32 and fp64 feature maps pass through unchanged: the anchors are torchvision's,
bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.image_list import ImageList

__all__ = ["FullPrecisionAnchorGenerator"]

_HALF = (torch.float16, torch.bfloat16)


def _fp32_stand_in(feature_map: Tensor) -> Tensor:
    """An fp32 tensor of ``feature_map``'s shape and device that owns one element (an expanded scalar)."""
    return torch.empty((), dtype=torch.float32, device=feature_map.device).expand(feature_map.shape)


class FullPrecisionAnchorGenerator(AnchorGenerator):
    """torchvision's ``AnchorGenerator`` with anchors in fp32 when the feature maps are bf16/fp16.

    Same arguments, attributes and (empty) state dict as ``AnchorGenerator``, so checkpoints are unchanged.
    """

    def forward(self, image_list: ImageList, feature_maps: list[Tensor]) -> list[Tensor]:
        if feature_maps and feature_maps[0].dtype in _HALF:
            feature_maps = [_fp32_stand_in(feature_map) for feature_map in feature_maps]
        return super().forward(image_list, feature_maps)

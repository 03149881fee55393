"""Pairwise box IoU for the anchor and proposal matchers, as one fused kernel.

torchvision's ``box_iou`` builds several ``[N, M, 2]`` temporaries; the matcher only needs the IoU matrix,
so the kernel writes it directly, in fp32 even for half-precision boxes (matcher thresholds such as 0.7
must not be compared in fp16).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_amp_det.ops import reference
from lit_amp_det.ops._extension import extension_available, has_kernel

__all__ = ["box_iou"]


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """Intersection over union of every pair of boxes.

    Args:
        boxes1 (Tensor[N, 4]): ``(x1, y1, x2, y2)`` boxes.
        boxes2 (Tensor[M, 4]): ``(x1, y1, x2, y2)`` boxes.

    Returns:
        Tensor[N, M]: float32 (float64 when an input is float64). A pair whose union is not positive
        (two zero-area boxes) has IoU 0, where torchvision gives NaN. Not differentiable.
    """
    if has_kernel("box_iou", boxes1.device):
        return torch.ops.lit_amp_det.box_iou(boxes1, boxes2)
    return reference.box_iou(boxes1, boxes2)


if extension_available():

    @torch.library.register_fake("lit_amp_det::box_iou")
    def _box_iou_fake(boxes1: Tensor, boxes2: Tensor) -> Tensor:
        for name, boxes in (("boxes1", boxes1), ("boxes2", boxes2)):
            torch._check(boxes.dim() == 2 and boxes.shape[-1] == 4, lambda: f"{name} must be [N, 4]")
        dtype = torch.float64 if torch.float64 in (boxes1.dtype, boxes2.dtype) else torch.float32
        return boxes1.new_empty((boxes1.shape[0], boxes2.shape[0]), dtype=dtype)

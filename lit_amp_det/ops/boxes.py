"""Pairwise box IoU for the anchor and proposal matchers, as one fused kernel.

torchvision's ``box_iou`` builds several ``[N, M, 2]`` temporaries; the matcher only needs the IoU matrix, so
the kernel writes it directly, in fp32 even for half-precision boxes (matcher thresholds such as 0.7 must not
be compared in fp16).
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
        Tensor[N, M]: float32 (float64 when an input is float64). Integer boxes are accepted, as by
        torchvision: their areas are formed exactly (in float64) and the IoU is returned in float32. IoU is
        never NaN: a pair whose union is not positive (two zero-area boxes) or whose boxes have infinite
        coordinates has IoU 0, where torchvision gives NaN. Not differentiable.

    Scriptable with ``torch.jit.script`` when the compiled extension is loaded, like torchvision's.
    """
    integer_input = not (boxes1.is_floating_point() and boxes2.is_floating_point())
    if integer_input:
        boxes1, boxes2 = _exact_float(boxes1), _exact_float(boxes2)
    if torch.jit.is_scripting():  # TorchScript compiles this branch only
        iou = torch.ops.lit_amp_det.box_iou(boxes1, boxes2)
    else:
        iou = _eager_box_iou(boxes1, boxes2)
    return iou.float() if integer_input else iou


def _eager_box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """The compiled kernel where the extension has one for the device, the reference otherwise."""
    if has_kernel("box_iou", boxes1.device):
        return torch.ops.lit_amp_det.box_iou(boxes1, boxes2)
    return reference.box_iou(boxes1, boxes2)


def _exact_float(boxes: Tensor) -> Tensor:
    """Integer coordinates in float64 (exact up to 2**53); float boxes as they are."""
    return boxes if boxes.is_floating_point() else boxes.double()


if extension_available():

    @torch.library.register_fake("lit_amp_det::box_iou")
    def _box_iou_fake(boxes1: Tensor, boxes2: Tensor) -> Tensor:
        for name, boxes in (("boxes1", boxes1), ("boxes2", boxes2)):
            torch._check(
                boxes.dim() == 2 and boxes.shape[-1] == 4,
                lambda name=name: f"{name} must be [N, 4]",
            )
        dtype = torch.float64 if torch.float64 in (boxes1.dtype, boxes2.dtype) else torch.float32
        return boxes1.new_empty((boxes1.shape[0], boxes2.shape[0]), dtype=dtype)

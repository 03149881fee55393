"""lit_amp_det's detection ops: C++/CUDA kernels with a pure-PyTorch fallback.

* :func:`nms` / :func:`batched_nms` -- greedy NMS that stops at ``max_output`` kept boxes;
  :func:`batched_nms_padded` returns them padded to a fixed size with a count (no host sync).
* :func:`roi_align` / :class:`RoIAlign` -- torchvision's RoIAlign, native in fp16/bf16 and channels_last.
* :func:`multi_level_roi_align` / :class:`MultiScaleRoIAlign` -- every FPN level pooled in one call.
* :func:`box_iou` -- the matchers' IoU matrix, in fp32.

The kernels live in ``lit_amp_det/csrc`` and register under ``torch.ops.lit_amp_det``; each function here
has a fake kernel for ``torch.compile``/export and, where differentiable, an autograd formula. Without the
compiled extension every op runs its :mod:`lit_amp_det.ops.reference` implementation and warns once.
"""

from lit_amp_det.ops._extension import compiled_cuda_version, extension_available, extension_error
from lit_amp_det.ops.boxes import box_iou
from lit_amp_det.ops.nms import batched_nms, batched_nms_padded, nms
from lit_amp_det.ops.poolers import MultiScaleRoIAlign, assign_fpn_levels, infer_spatial_scale
from lit_amp_det.ops.roi_align import RoIAlign, boxes_to_rois, multi_level_roi_align, roi_align

__all__ = [
    "MultiScaleRoIAlign",
    "RoIAlign",
    "assign_fpn_levels",
    "batched_nms",
    "batched_nms_padded",
    "box_iou",
    "boxes_to_rois",
    "compiled_cuda_version",
    "extension_available",
    "extension_error",
    "infer_spatial_scale",
    "multi_level_roi_align",
    "nms",
    "roi_align",
]

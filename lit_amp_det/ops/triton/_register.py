"""Registers the Triton launchers as the CUDA kernels of the ``lit_amp_det::`` ops defined in
``lit_amp_det/csrc``.

The schemas, CPU kernels, fake kernels and autograd formulas stay where they are; only the CUDA dispatch key
is filled here, once per process, by :func:`register_cuda_kernels` (called by
:mod:`lit_amp_det.ops._extension` after the compiled extension has defined the ops). It imports neither triton
nor the kernels: that happens on the first call with a CUDA tensor, so CPU-only machines pay nothing at
import. ``torch.compile`` and ``torch.export`` trace the ops by their schemas and fake kernels; these kernels
run only when an op runs on CUDA tensors, eagerly or inside a compiled graph, so their launches go straight to
Triton's launcher (:func:`._launch._launch`).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

__all__ = ["register_cuda_kernels", "registered"]

_LIBRARY: torch.library.Library | None = None
_LAUNCHERS: ModuleType | None = None


def _launchers() -> ModuleType:
    """:mod:`._launch`, imported on the first CUDA call and kept: an import statement in every op call would
    add to the host time that each launch saves by not going through the dispatcher.
    """
    global _LAUNCHERS
    if _LAUNCHERS is None:
        from lit_amp_det.ops.triton import _launch

        _LAUNCHERS = _launch
    return _LAUNCHERS


def _nms(boxes, scores, iou_threshold, max_output=-1):
    return _launchers().nms(boxes, scores, iou_threshold, max_output)


def _batched_nms(boxes, scores, idxs, iou_threshold, max_output=-1):
    return _launchers().batched_nms(boxes, scores, idxs, iou_threshold, max_output)


def _batched_nms_padded(boxes, scores, idxs, valid, iou_threshold, max_output=-1, max_class_size=-1):
    return _launchers().batched_nms_padded(
        boxes,
        scores,
        idxs,
        iou_threshold,
        max_output,
        valid=valid,
        max_class_size=None if max_class_size < 0 else max_class_size,
    )


def _box_iou(boxes1, boxes2):
    return _launchers().box_iou(boxes1, boxes2)


def _roi_align(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    return _launchers().roi_align(
        input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned
    )


def _roi_align_backward(
    grad,
    rois,
    spatial_scale,
    pooled_height,
    pooled_width,
    batch_size,
    channels,
    height,
    width,
    sampling_ratio,
    aligned,
):
    return _launchers().roi_align_backward(
        grad,
        rois,
        spatial_scale,
        pooled_height,
        pooled_width,
        batch_size,
        channels,
        height,
        width,
        sampling_ratio,
        aligned,
    )


def _multi_level_roi_align(
    features, rois, levels, spatial_scales, pooled_height, pooled_width, sampling_ratio, aligned
):
    return _launchers().multi_level_roi_align(
        features, rois, levels, spatial_scales, pooled_height, pooled_width, sampling_ratio, aligned
    )


def _multi_level_roi_align_backward(
    grad, features, rois, levels, spatial_scales, pooled_height, pooled_width, sampling_ratio, aligned
):
    return _launchers().multi_level_roi_align_backward(
        grad, features, rois, levels, spatial_scales, pooled_height, pooled_width, sampling_ratio, aligned
    )


_KERNELS = {
    "nms": _nms,
    "batched_nms": _batched_nms,
    "batched_nms_padded": _batched_nms_padded,
    "box_iou": _box_iou,
    "roi_align": _roi_align,
    "_roi_align_backward": _roi_align_backward,
    "multi_level_roi_align": _multi_level_roi_align,
    "_multi_level_roi_align_backward": _multi_level_roi_align_backward,
}


def register_cuda_kernels() -> bool:
    """Fills the CUDA key of every ``lit_amp_det::`` op with its Triton launcher; idempotent.

    Returns whether the kernels are registered: False when triton is not installed (the ops then fall back to
    their reference implementation on CUDA tensors). The ops must already be defined (extension loaded).
    """
    global _LIBRARY
    if _LIBRARY is not None:
        return True
    if importlib.util.find_spec("triton") is None:
        return False
    library = torch.library.Library("lit_amp_det", "IMPL")
    for name, kernel in _KERNELS.items():
        library.impl(name, kernel, "CUDA")
    _LIBRARY = library
    return True


def registered() -> bool:
    """Whether :func:`register_cuda_kernels` has registered the kernels in this process."""
    return _LIBRARY is not None

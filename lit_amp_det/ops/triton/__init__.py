"""lit_amp_det's ops as Triton kernels, callable directly on any device Triton runs on.

The same public names as :mod:`lit_amp_det.ops` plus the host-sync-free ``nms_padded`` /
``batched_nms_padded``, calling the Triton kernels of :mod:`._kernels` directly. These kernels are also what
``torch.ops.lit_amp_det.*`` runs on CUDA tensors, so both compute the same thing. On CPU tensors they run
through Triton's interpreter under ``TRITON_INTERPRET=1`` (slow; for testing without a GPU). RoIAlign is
differentiable here too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lit_amp_det.ops.triton import _launch

__all__ = [
    "MultiScaleRoIAlign",
    "RoIAlign",
    "batched_nms",
    "batched_nms_padded",
    "box_iou",
    "multi_level_roi_align",
    "nms",
    "nms_padded",
    "roi_align",
]


# lit_amp_det.ops.roi_align's helpers are imported when first needed: lit_amp_det.ops imports this package's
# _register while it is itself being imported, and lit_amp_det.ops.roi_align imports lit_amp_det.ops.
def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    from lit_amp_det.ops.roi_align import _pair as pair

    return pair(size)


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """IoU of every pair: ``boxes1 (Tensor[N, 4])``, ``boxes2 (Tensor[M, 4])`` -> ``Tensor[N, M]``.

    float32 (float64 if an input is float64; integer boxes are computed exactly, float32 out); a pair whose
    union is not positive, or whose ratio is NaN, has IoU 0.
    """
    return _launch.box_iou(boxes1, boxes2)


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float, max_output: int = -1) -> Tensor:
    """Greedy NMS; arguments and result as :func:`lit_amp_det.ops.nms` (kept indices, int64, by decreasing
    score).

    Sizing the result reads the kept count once; :func:`nms_padded` does not.
    """
    return _launch.nms(boxes, scores, iou_threshold, max_output)


def batched_nms(
    boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float, max_output: int = -1
) -> Tensor:
    """NMS within each class of ``idxs (Tensor[N], integer)``, one global ``max_output``; see :func:`nms`."""
    return _launch.batched_nms(boxes, scores, idxs, iou_threshold, max_output)


def nms_padded(
    boxes: Tensor, scores: Tensor, iou_threshold: float, max_output: int = -1, *, valid: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """:func:`batched_nms_padded` with one class."""
    return _launch.nms_padded(boxes, scores, iou_threshold, max_output, valid=valid)


def batched_nms_padded(
    boxes: Tensor,
    scores: Tensor,
    idxs: Tensor,
    iou_threshold: float,
    max_output: int = -1,
    *,
    valid: Tensor | None = None,
    max_class_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`lit_amp_det.ops.batched_nms_padded` (arguments and result) on the Triton kernels: what the op
    runs on CUDA tensors.
    """
    return _launch.batched_nms_padded(
        boxes, scores, idxs, iou_threshold, max_output, valid=valid, max_class_size=max_class_size
    )


class _RoIAlignFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        input: Tensor,
        rois: Tensor,
        spatial_scale: float,
        pooled: tuple[int, int],
        sampling_ratio: int,
        aligned: bool,
    ) -> Tensor:
        ctx.save_for_backward(rois)
        ctx.input_shape = tuple(input.shape)
        ctx.params = (spatial_scale, pooled, sampling_ratio, aligned)
        return _launch.roi_align(input, rois, spatial_scale, pooled[0], pooled[1], sampling_ratio, aligned)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (rois,) = ctx.saved_tensors
        spatial_scale, pooled, sampling_ratio, aligned = ctx.params
        grad_input = _launch.roi_align_backward(
            grad, rois, spatial_scale, pooled[0], pooled[1], *ctx.input_shape, sampling_ratio, aligned
        )
        return grad_input, None, None, None, None, None


class _MultiLevelRoIAlignFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        rois: Tensor,
        levels: Tensor,
        spatial_scales: tuple[float, ...],
        pooled: tuple[int, int],
        sampling_ratio: int,
        aligned: bool,
        *features: Tensor,
    ) -> Tensor:
        ctx.save_for_backward(rois, levels, *features)
        ctx.params = (spatial_scales, pooled, sampling_ratio, aligned)
        return _launch.multi_level_roi_align(
            features, rois, levels, spatial_scales, pooled[0], pooled[1], sampling_ratio, aligned
        )

    @staticmethod
    def backward(ctx, grad: Tensor):
        rois, levels, *features = ctx.saved_tensors
        spatial_scales, pooled, sampling_ratio, aligned = ctx.params
        grads = _launch.multi_level_roi_align_backward(
            grad, features, rois, levels, spatial_scales, pooled[0], pooled[1], sampling_ratio, aligned
        )
        return (None, None, None, None, None, None, *grads)


def roi_align(
    input: Tensor,
    boxes: Tensor | Sequence[Tensor],
    output_size: int | Sequence[int],
    spatial_scale: float = 1.0,
    sampling_ratio: int = -1,
    aligned: bool = False,
) -> Tensor:
    """torchvision's RoIAlign; arguments and result as :func:`lit_amp_det.ops.roi_align`.

    The input (contiguous or channels_last) is read in place; the result, in its dtype and layout, is
    differentiable w.r.t. input.
    """
    from lit_amp_det.ops.roi_align import boxes_to_rois  # imported here: see _pair

    rois = boxes_to_rois(boxes)
    return _RoIAlignFunction.apply(
        input, rois, float(spatial_scale), _pair(output_size), int(sampling_ratio), bool(aligned)
    )


def multi_level_roi_align(
    features: Sequence[Tensor],
    rois: Tensor,
    levels: Tensor,
    spatial_scales: Sequence[float],
    output_size: int | Sequence[int],
    sampling_ratio: int = -1,
    aligned: bool = False,
) -> Tensor:
    """Row k is RoIAlign of ``rois[k]`` on ``features[levels[k]]``.

    Arguments and result as :func:`lit_amp_det.ops.multi_level_roi_align`; differentiable w.r.t. every level.
    """
    return _MultiLevelRoIAlignFunction.apply(
        rois,
        levels,
        tuple(float(s) for s in spatial_scales),
        _pair(output_size),
        int(sampling_ratio),
        bool(aligned),
        *features,
    )


def __getattr__(name: str) -> type:
    # the module classes subclass lit_amp_det.ops' own, which cannot be imported while lit_amp_det.ops is
    if name in ("RoIAlign", "MultiScaleRoIAlign"):
        from lit_amp_det.ops.triton import modules

        return getattr(modules, name)
    raise AttributeError(f"module 'lit_amp_det.ops.triton' has no attribute {name!r}")

"""ONNX translations of the package's inference ops (``torch.onnx.export``'s ``custom_translation_table``).

Each function receives the op's arguments as ONNX values (tensors) and Python constants (the schema's
``float``, ``int`` and ``bool`` arguments) and builds standard ONNX nodes (opset 18), so onnxruntime and
TensorRT run the exported graph without a custom-op library:

* ``batched_nms_padded`` -> ``NonMaxSuppression`` on boxes moved apart per class (torchvision's coordinate
  trick), the ``valid`` mask as a score below the threshold, the kept indices padded with ``-1`` by ``Concat``
  + ``Slice``. Kept boxes and their order match; among equal scores ONNX Runtime keeps the lower index first.
* ``roi_align`` / ``multi_level_roi_align`` -> ``RoiAlign`` (``aligned`` is ``half_pixel``, else
  ``output_half_pixel``, as torchvision's own ONNX export maps it; adaptive sampling is ``sampling_ratio=0``
  in both). ONNX has no per-RoI level, so every level pools every RoI and ``Where`` keeps each RoI's own: the
  same values, with the pooling done once per FPN level.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from onnxscript import opset18 as op  # the export extra: imported only when an ONNX export runs

__all__ = ["translation_table"]

_FLOAT = 1  # onnx.TensorProto.FLOAT
_INT64 = 7


def _batched_nms_padded(
    boxes: Any,
    scores: Any,
    idxs: Any,
    valid: Any = None,
    iou_threshold: float = 0.5,
    max_output: int = -1,
    max_class_size: int = -1,
) -> tuple[Any, Any]:
    def ints(*values: int) -> Any:
        return op.Constant(value_ints=list(values))

    boxes, scores = op.Cast(boxes, to=_FLOAT), op.Cast(scores, to=_FLOAT)
    count = op.Shape(scores, start=0, end=1)
    limit = count if max_output < 0 else op.Min(count, ints(max_output))
    if valid is not None:  # below the score threshold: neither kept nor suppressing
        scores = op.Where(valid, scores, op.Constant(value_float=float("-inf")))
    span = op.Add(op.ReduceMax(boxes, keepdims=0), op.Constant(value_float=1.0))
    moved = op.Add(boxes, op.Unsqueeze(op.Mul(op.Cast(idxs, to=_FLOAT), span), ints(1)))
    selected = op.NonMaxSuppression(
        op.Unsqueeze(moved, ints(0)),
        op.Unsqueeze(scores, ints(0, 1)),
        limit,
        op.Constant(value_floats=[float(iou_threshold)]),
        op.Constant(value_floats=[-3.0e38]),
        center_point_box=0,
    )
    kept = op.Gather(selected, op.Constant(value_int=2), axis=1)
    padded = op.Slice(op.Concat(kept, op.Expand(ints(-1), limit), axis=0), ints(0), limit)
    return padded, op.Squeeze(op.Shape(kept), ints(0))


def _pool(
    feature: Any,
    rois: Any,
    scale: float,
    pooled_height: int,
    pooled_width: int,
    sampling_ratio: int,
    aligned: bool,
) -> Any:
    batch_index = op.Cast(op.Gather(rois, op.Constant(value_int=0), axis=1), to=_INT64)
    corners = op.Slice(
        rois, op.Constant(value_ints=[1]), op.Constant(value_ints=[5]), op.Constant(value_ints=[1])
    )
    return op.RoiAlign(
        feature,
        op.CastLike(corners, feature),
        batch_index,
        mode="avg",
        coordinate_transformation_mode="half_pixel" if aligned else "output_half_pixel",
        output_height=pooled_height,
        output_width=pooled_width,
        sampling_ratio=max(int(sampling_ratio), 0),
        spatial_scale=float(scale),
    )


def _roi_align(
    features: Any,
    rois: Any,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    sampling_ratio: int,
    aligned: bool,
) -> Any:
    return _pool(features, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)


def _multi_level_roi_align(
    features: Sequence[Any],
    rois: Any,
    levels: Any,
    spatial_scales: Sequence[float],
    pooled_height: int,
    pooled_width: int,
    sampling_ratio: int,
    aligned: bool,
) -> Any:
    pooled = None
    for level, (feature, scale) in enumerate(zip(features, spatial_scales)):
        here = _pool(feature, rois, scale, pooled_height, pooled_width, sampling_ratio, aligned)
        if pooled is None:
            pooled = here
        else:
            mine = op.Equal(levels, op.CastLike(op.Constant(value_int=level), levels))
            pooled = op.Where(op.Reshape(mine, op.Constant(value_ints=[-1, 1, 1, 1])), here, pooled)
    return pooled


def translation_table() -> dict[Any, Any]:
    """``{op overload: translation}`` for ``torch.onnx.export``'s ``custom_translation_table``."""
    ops = torch.ops.lit_amp_det
    return {
        ops.batched_nms_padded.default: _batched_nms_padded,
        ops.roi_align.default: _roi_align,
        ops.multi_level_roi_align.default: _multi_level_roi_align,
    }

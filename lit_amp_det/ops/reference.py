"""Pure-PyTorch implementations of every op in :mod:`lit_amp_det.ops`.

They define the semantics the compiled kernels must match (see ``lit_amp_det/csrc/README.md``), serve as the
float64 test reference, and are the fallback when the extension is not built. They favour clarity over speed
but stay vectorised, so the fallback is usable for small models: NMS loops once per *kept* box over a
shrinking list of survivors, RoIAlign gathers all bilinear samples of a chunk of RoIs at once and gets its
gradient from autograd.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["batched_nms", "batched_nms_padded", "box_iou", "multi_level_roi_align", "nms", "roi_align"]


def _accumulation_dtype(*tensors: Tensor) -> torch.dtype:
    """fp64 when any input is fp64, fp32 otherwise: what the references compute in (half and bfloat16 in
    fp32).
    """
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _area(boxes: Tensor) -> Tensor:
    return (boxes[..., 2] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 1])


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """IoU of every pair: ``boxes1 (Tensor[N, 4])``, ``boxes2 (Tensor[M, 4])`` -> ``Tensor[N, M]``.

    Computed in fp32 (fp64 if an input is fp64); a pair whose union is not positive, or whose IoU is not a
    number (infinite coordinates), has IoU 0.
    """
    dtype = _accumulation_dtype(boxes1, boxes2)
    a, b = boxes1.to(dtype), boxes2.to(dtype)
    top_left = torch.maximum(a[:, None, :2], b[None, :, :2])
    bottom_right = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = (bottom_right - top_left).clamp(min=0)
    inter = wh[..., 0] * wh[..., 1]
    union = _area(a)[:, None] + _area(b)[None, :] - inter
    iou = torch.where(union > 0, inter / union.where(union > 0, 1), 0)
    return iou.where(iou == iou, 0)  # inf / inf from infinite coordinates: 0, never NaN


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float, max_output: int = -1) -> Tensor:
    """Greedy NMS: kept indices (int64) in decreasing score order, ties broken by lower index.

    A box is dropped when a kept box overlaps it with IoU strictly greater than ``iou_threshold``;
    ``max_output >= 0`` stops once that many boxes are kept.
    """
    order = torch.sort(scores, descending=True, stable=True).indices
    sorted_boxes = boxes.to(_accumulation_dtype(boxes))[order]
    alive = torch.arange(order.numel(), device=boxes.device)
    kept: list[Tensor] = []
    while alive.numel() > 0 and (max_output < 0 or len(kept) < max_output):
        best, rest = alive[0], alive[1:]
        kept.append(best)
        iou = box_iou(sorted_boxes[best][None], sorted_boxes[rest])[0]
        alive = rest[iou.double() <= iou_threshold]  # like the kernels: fp32 IoU against the exact threshold
    if not kept:
        return order.new_empty(0)
    return order[torch.stack(kept)]


def batched_nms(
    boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float, max_output: int = -1
) -> Tensor:
    """NMS within each class of ``idxs``; kept indices over all classes by decreasing score (ties: lower
    index).
    """
    kept = [
        members[nms(boxes[members], scores[members], iou_threshold, max_output)]
        for members in (torch.nonzero(idxs == c).flatten() for c in torch.unique(idxs))
    ]
    if not kept:
        return idxs.new_empty(0, dtype=torch.int64)
    keep = torch.sort(torch.cat(kept)).values  # by index first, so the stable score sort breaks ties by index
    keep = keep[torch.sort(scores[keep], descending=True, stable=True).indices]
    return keep if max_output < 0 else keep[:max_output]


def batched_nms_padded(
    boxes: Tensor,
    scores: Tensor,
    idxs: Tensor,
    iou_threshold: float,
    max_output: int = -1,
    valid: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`batched_nms` of the ``valid`` boxes as ``(kept indices padded with -1 to min(N, max_output),
    count)``.
    """
    n = boxes.shape[0]
    limit = n if max_output < 0 else min(n, max_output)
    members = torch.arange(n, device=boxes.device) if valid is None else torch.nonzero(valid).flatten()
    keep = members[batched_nms(boxes[members], scores[members], idxs[members], iou_threshold, limit)]
    padded = torch.full((limit,), -1, dtype=torch.int64, device=boxes.device)
    padded[: keep.shape[0]] = keep
    return padded, torch.tensor(keep.shape[0], device=boxes.device)


def _sample_axis(
    start: Tensor, size: Tensor, bins: int, grid: Tensor, max_grid: int, limit: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Bilinear taps along one axis for every (roi, bin, sample): low index, high index, their weights.

    Samples outside ``[-1, limit]`` and padding samples beyond a roi's own grid get weight 0.
    Shapes: ``start``, ``size``, ``grid`` are ``[K]``; results are ``[K, bins, max_grid]``.
    """
    step = size / bins
    sample = torch.arange(max_grid, device=start.device, dtype=start.dtype)
    pos = (
        start[:, None, None]
        + torch.arange(bins, device=start.device, dtype=start.dtype)[None, :, None] * step[:, None, None]
        + (sample[None, None, :] + 0.5) * (step / grid.clamp(min=1))[:, None, None]
    )
    inside = (pos >= -1.0) & (pos <= limit) & (sample[None, None, :] < grid[:, None, None])
    pos = pos.clamp(min=0)
    low = pos.floor().long()
    at_edge = low >= limit - 1
    low = torch.where(at_edge, limit - 1, low)
    high = torch.where(at_edge, limit - 1, low + 1)
    pos = torch.where(at_edge, low.to(pos.dtype), pos)
    frac = pos - low
    return low, high, (1 - frac) * inside, frac * inside


def _roi_align_chunk(
    feature: Tensor, rois: Tensor, pooled: tuple[int, int], scale: float, sampling_ratio: int, aligned: bool
) -> Tensor:
    dtype = rois.dtype
    height, width = feature.shape[-2:]
    offset = 0.5 if aligned else 0.0
    x1, y1, x2, y2 = (rois[:, i] * scale - offset for i in range(1, 5))
    roi_w, roi_h = x2 - x1, y2 - y1
    if not aligned:
        roi_w, roi_h = roi_w.clamp(min=1), roi_h.clamp(min=1)
    if sampling_ratio > 0:
        grid_h = grid_w = torch.full_like(roi_h, sampling_ratio)
    else:
        grid_h, grid_w = torch.ceil(roi_h / pooled[0]), torch.ceil(roi_w / pooled[1])
    max_h = max(int(grid_h.max()), 1)
    max_w = max(int(grid_w.max()), 1)
    y_low, y_high, wy_low, wy_high = _sample_axis(y1, roi_h, pooled[0], grid_h, max_h, height)
    x_low, x_high, wx_low, wx_high = _sample_axis(x1, roi_w, pooled[1], grid_w, max_w, width)

    # a roi whose batch index is outside [0, N) (NaN included) pools to zeros, as in the kernels
    addressable = (rois[:, 0] > -1) & (rois[:, 0] < feature.shape[0])
    image = rois[:, 0].where(addressable, 0).long()[:, None, None, None, None]
    values = feature.to(dtype)
    out = 0
    for ys, wy in ((y_low, wy_low), (y_high, wy_high)):
        for xs, wx in ((x_low, wx_low), (x_high, wx_high)):
            # [K, ph, gh, pw, gw, C]: the advanced indices come first, channels last
            taps = values[image, :, ys[:, :, :, None, None], xs[:, None, None, :, :]]
            out = out + taps * (wy[:, :, :, None, None] * wx[:, None, None, :, :])[..., None]
    count = (grid_h * grid_w).clamp(min=1)
    pooled_out = out.sum(dim=(2, 4)) / count[:, None, None, None] * addressable[:, None, None, None]
    return pooled_out.permute(0, 3, 1, 2)


def roi_align(
    input: Tensor,
    rois: Tensor,
    output_size: int | Sequence[int],
    spatial_scale: float = 1.0,
    sampling_ratio: int = -1,
    aligned: bool = False,
    *,
    chunk: int = 64,
) -> Tensor:
    """torchvision's RoIAlign on ``input (Tensor[N, C, H, W])`` and ``rois (Tensor[K, 5])`` -> ``Tensor[K, C,
    ph, pw]``.

    Computed in fp32 (fp64 for fp64 input) whatever the RoI dtype; the output has the input's dtype.
    RoIs go through in chunks of ``chunk`` to bound the memory of the gathered samples.
    """
    pooled = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    acc = torch.float64 if input.dtype == torch.float64 else torch.float32
    rois = rois.to(acc)
    if rois.shape[0] == 0:
        return input.new_zeros((0, input.shape[1], *pooled))
    parts = [
        _roi_align_chunk(input, part, pooled, spatial_scale, sampling_ratio, aligned)
        for part in rois.split(chunk)
    ]
    return torch.cat(parts).to(input.dtype)


def multi_level_roi_align(
    features: Sequence[Tensor],
    rois: Tensor,
    levels: Tensor,
    spatial_scales: Sequence[float],
    output_size: int | Sequence[int],
    sampling_ratio: int = -1,
    aligned: bool = False,
) -> Tensor:
    """Row k is ``roi_align(features[levels[k]], rois[k], spatial_scales[levels[k]])``: ``Tensor[K, C, ph,
    pw]``.
    """
    pooled = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    first = features[0]
    out = first.new_zeros((rois.shape[0], first.shape[1], *pooled))
    for level, (feature, scale) in enumerate(zip(features, spatial_scales)):
        rows = torch.nonzero(levels == level).flatten()
        if rows.numel():
            out = out.index_put(
                (rows,), roi_align(feature, rois[rows], pooled, scale, sampling_ratio, aligned)
            )
    return out

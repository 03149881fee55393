"""Pure-PyTorch implementations of every op in :mod:`lit_amp_det.ops`.

They define the semantics the compiled kernels must match (see ``lit_amp_det/csrc/README.md``), serve as
the float64 test reference, and are the fallback when the extension is not built. They favour clarity over
speed but stay vectorised, so the fallback is usable for small models: NMS loops once per *kept* box over a
shrinking list of survivors, RoIAlign gathers all bilinear samples of a chunk of RoIs at once and gets its
gradient from autograd.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "batched_nms",
    "box_iou",
    "multi_level_roi_align",
    "nms",
    "roi_align",
    "winograd_gradient_tiles_",
    "winograd_input_tiles_",
    "winograd_output_",
    "winograd_weight_gradient_",
    "winograd_weight_tiles_",
]


def _accumulation_dtype(*tensors: Tensor) -> torch.dtype:
    """fp64 when any input is fp64, fp32 otherwise: what the references compute in (half and bfloat16 boxes are
    compared, and half tiles transformed, in fp32)."""
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
    """NMS within each class of ``idxs``; kept indices over all classes in decreasing score order (ties: lower index)."""
    kept = [
        members[nms(boxes[members], scores[members], iou_threshold, max_output)]
        for members in (torch.nonzero(idxs == c).flatten() for c in torch.unique(idxs))
    ]
    if not kept:
        return idxs.new_empty(0, dtype=torch.int64)
    keep = torch.sort(torch.cat(kept)).values  # by index first, so the stable score sort breaks ties by index
    keep = keep[torch.sort(scores[keep], descending=True, stable=True).indices]
    return keep if max_output < 0 else keep[:max_output]


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
    """torchvision's RoIAlign on ``input (Tensor[N, C, H, W])`` and ``rois (Tensor[K, 5])`` -> ``Tensor[K, C, ph, pw]``.

    Computed in fp32 (fp64 for fp64 input) whatever the RoI dtype; the output has the input's dtype.
    RoIs go through in chunks of ``chunk`` to bound the memory of the gathered samples.
    """
    pooled = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    acc = torch.float64 if input.dtype == torch.float64 else torch.float32
    rois = rois.to(acc)
    if rois.shape[0] == 0:
        return input.new_zeros((0, input.shape[1], *pooled))
    parts = [
        _roi_align_chunk(input, part, pooled, spatial_scale, sampling_ratio, aligned) for part in rois.split(chunk)
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
    """Row k is ``roi_align(features[levels[k]], rois[k], spatial_scales[levels[k]])``: ``Tensor[K, C, ph, pw]``."""
    pooled = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    first = features[0]
    out = first.new_zeros((rois.shape[0], first.shape[1], *pooled))
    for level, (feature, scale) in enumerate(zip(features, spatial_scales)):
        rows = torch.nonzero(levels == level).flatten()
        if rows.numel():
            out = out.index_put((rows,), roi_align(feature, rois[rows], pooled, scale, sampling_ratio, aligned))
    return out



def master_sgd_step_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    momentum_buffers: Sequence[Tensor],
    low_weights: Sequence[Tensor],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    grad_scale: float,
    first_step: bool,
) -> None:
    """``torch.optim.SGD``'s update of fp32 ``params`` from ``grads`` of any float dtype (widened to fp32, times
    ``grad_scale``), then ``low_weights[i].copy_(params[i])`` (when given). In place; plain PyTorch."""
    if not params:
        return
    with torch.no_grad():
        g = [grad.to(torch.float32, copy=True) for grad in grads]
        if grad_scale != 1.0:
            torch._foreach_mul_(g, grad_scale)
        if maximize:
            torch._foreach_neg_(g)
        if weight_decay != 0:
            torch._foreach_add_(g, list(params), alpha=weight_decay)
        if momentum != 0:
            bufs = list(momentum_buffers)
            if first_step:
                torch._foreach_copy_(bufs, g)
            else:
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, g, alpha=1 - dampening)
            if nesterov:
                torch._foreach_add_(g, bufs, alpha=momentum)
            else:
                g = bufs
        torch._foreach_add_(list(params), g, alpha=-lr)
        for low, param in zip(low_weights, params):
            low.copy_(param)


def all_finite(tensors: Sequence[Tensor]) -> Tensor:
    """0-dim bool tensor: no element of any floating tensor is inf or NaN."""
    floating = [t for t in tensors if t.is_floating_point()]
    if not floating:
        return torch.tensor(True)
    return torch.stack([torch.isfinite(t).all() for t in floating]).all()


# Winograd F(2x2, 3x3) and F(4x4, 3x3) tile transforms (csrc/README.md): with m x m output tiles (m = 2 or 4; 16 or
# 36 transform positions, the tiles' first dimension), tile (n, i, j) covers output pixels m*i..m*i+m-1, m*j..m*j+m-1.
_WINOGRAD_BT = {
    2: ((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1)),
    4: ((4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0), (0, -2, -1, 2, 1, 0), (0, 2, -1, -2, 1, 0),
        (0, 4, 0, -5, 0, 1)),
}
_WINOGRAD_AT = {
    2: ((1, 1, 1, 0), (0, 1, -1, -1)),
    4: ((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0), (0, 1, -1, 8, -8, 1)),
}
_WINOGRAD_GRAD_G = {  # G': the output-gradient tile's transform (the weight gradient is F(3x3, m x m))
    2: ((1, 0), (0.5, 0.5), (0.5, -0.5), (0, -1)),
    4: ((1 / 4, 0, 0, 0), (-1 / 6, -1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6, 1 / 6),
        (1 / 24, 1 / 12, 1 / 6, 1 / 3), (1 / 24, -1 / 12, 1 / 6, -1 / 3), (0, 0, 0, 1)),
}
_WINOGRAD_G = {  # G: a 3x3 filter's transform
    2: ((1, 0, 0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0, 0, 1)),
    4: ((1 / 4, 0, 0), (-1 / 6, -1 / 6, -1 / 6), (-1 / 6, 1 / 6, -1 / 6), (1 / 24, 1 / 12, 1 / 6),
        (1 / 24, -1 / 12, 1 / 6), (0, 0, 1)),
}
_WINOGRAD_GRAD_AT = {  # A': the weight gradient's back transform of the summed products
    2: ((1, 1, 1, 0), (0, 1, -1, 0), (0, 1, 1, 1)),
    4: ((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 1)),
}
_WINOGRAD_SIDE = {16: 2, 36: 4}  # output tile side by transform positions


def _winograd_side(tiles: Tensor) -> int:
    if tiles.dim() != 3 or tiles.shape[0] not in _WINOGRAD_SIDE:
        raise ValueError(f"Winograd tiles must be [16 or 36, T, C], got {tuple(tiles.shape)}")
    return _WINOGRAD_SIDE[tiles.shape[0]]


def _tiles(x: Tensor, side: int, offset: int, m: int) -> Tensor:
    """``[N, C, ceil(H/m), ceil(W/m), side, side]``: the side x side windows of ``x`` at (m*i + offset, m*j + offset),
    zero outside ``x``."""
    n, c, h, w = x.shape
    tiles_h, tiles_w = -(-h // m), -(-w // m)
    low = -offset
    padded = torch.nn.functional.pad(x, (low, m * tiles_w + side - m - w - low, low, m * tiles_h + side - m - h - low))
    return padded.unfold(2, side, m).unfold(3, side, m)


def _two_sided(matrix: tuple[tuple[float, ...], ...], tiles: Tensor) -> Tensor:
    """``M t M^T`` of every tile in ``[N, C, th, tw, k, k]`` -> ``[alpha^2 or m^2, T, C]`` in (row, column) order."""
    m = torch.tensor(matrix, dtype=tiles.dtype, device=tiles.device)
    out = torch.einsum("ar,bs,nctirs->abntic", m, m, tiles)
    return out.reshape(out.shape[0] * out.shape[1], -1, tiles.shape[1])


def winograd_input_tiles_(tiles: Tensor, input: Tensor, tile_begin: int = 0) -> None:  # noqa: A002
    """Writes ``B^T d B`` of the (m+2)x(m+2) tiles of ``input`` zero-padded by 1, tiles ``[tile_begin, tile_begin +
    T)``, into ``tiles`` ``[16 or 36, T, C]``."""
    m = _winograd_side(tiles)
    every = _two_sided(_WINOGRAD_BT[m], _tiles(input.to(_accumulation_dtype(input)), m + 2, -1, m))
    tiles.copy_(every[:, tile_begin:tile_begin + tiles.shape[1]])


def winograd_gradient_tiles_(tiles: Tensor, grad_output: Tensor, tile_begin: int = 0) -> None:
    """Writes ``G' g G'^T`` of the m x m tiles of ``grad_output``, tiles ``[tile_begin, tile_begin + T)``, into
    ``tiles``."""
    m = _winograd_side(tiles)
    acc = _accumulation_dtype(grad_output)
    every = _two_sided(_WINOGRAD_GRAD_G[m], _tiles(grad_output.to(acc), m, 0, m))
    tiles.copy_(every[:, tile_begin:tile_begin + tiles.shape[1]])


def winograd_output_(out: Tensor, products: Tensor, bias: Tensor | None, tile_begin: int = 0) -> None:
    """Writes ``A^T M A`` (+ ``bias``) of tiles ``[tile_begin, tile_begin + T)`` (``products``: ``[16 or 36, T,
    C]``) into their pixels of the ``[N, C, H, W]`` map ``out``; the other pixels keep their values."""
    m = _winograd_side(products)
    alpha = m + 2
    acc = _accumulation_dtype(products)
    batch_size, channels, height, width = out.shape
    tiles_h, tiles_w = -(-height // m), -(-width // m)
    count = products.shape[1]
    every = products.new_zeros((alpha * alpha, batch_size * tiles_h * tiles_w, channels), dtype=acc)
    every[:, tile_begin:tile_begin + count] = products.to(acc)
    a = torch.tensor(_WINOGRAD_AT[m], dtype=acc, device=products.device)
    tiles = every.reshape(alpha, alpha, batch_size, tiles_h, tiles_w, channels)
    full = torch.einsum("pa,qb,abntic->nctpiq", a, a, tiles).reshape(batch_size, channels, m * tiles_h, m * tiles_w)
    full = full[:, :, :height, :width]
    if bias is not None:
        full = full + bias.to(acc).view(1, -1, 1, 1)
    index = torch.arange(batch_size * tiles_h * tiles_w, device=out.device).view(batch_size, 1, tiles_h, tiles_w)
    index = index.repeat_interleave(m, 2).repeat_interleave(m, 3)[:, :, :height, :width]
    inside = (index >= tile_begin) & (index < tile_begin + count)
    out.copy_(torch.where(inside, full.to(out.dtype), out))


def winograd_weight_tiles_(tiles: Tensor, weight: Tensor, transposed: bool = False) -> None:
    """Writes ``G w G^T`` of each 3x3 filter ``w`` of ``weight`` ``[C_out, C_in, 3, 3]`` into ``tiles`` ``[16 or 36,
    C_in, C_out]``; ``transposed``: of each filter rotated by 180 degrees, into ``[16 or 36, C_out, C_in]``."""
    m = _winograd_side(tiles)
    acc = _accumulation_dtype(weight)
    g = torch.tensor(_WINOGRAD_G[m], dtype=acc, device=weight.device)
    filters = weight.to(acc).flip(2, 3) if transposed else weight.to(acc)
    every = torch.einsum("ai,bj,oxij->abox" if transposed else "ai,bj,oxij->abxo", g, g, filters)
    tiles.copy_(every.reshape(tiles.shape))


def winograd_weight_gradient_(grad_weight: Tensor, products: Tensor) -> None:
    """Writes ``A'^T s A'`` of each filter's alpha x alpha sum of products ``s`` (``products``: ``[16 or 36, C_out,
    C_in]``) into ``grad_weight`` ``[C_out, C_in, 3, 3]``."""
    m = _winograd_side(products)
    acc = _accumulation_dtype(products, grad_weight)
    back = torch.tensor(_WINOGRAD_GRAD_AT[m], dtype=acc, device=products.device)
    sums = products.to(acc).reshape(m + 2, m + 2, *products.shape[1:])
    grad_weight.copy_(torch.einsum("ia,jb,aboc->ocij", back, back, sums))

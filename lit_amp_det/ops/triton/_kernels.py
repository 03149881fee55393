"""The ``@triton.jit`` kernels of every lit_amp_det op (launched from :mod:`lit_amp_det.ops.triton._launch`).

This module only defines kernels. :mod:`._launch` imports it twice: once as a normal module (compiled for the
GPU) and, when a CPU tensor arrives under ``TRITON_INTERPRET=1``, once more with Triton's interpreter switched
on, so the same source runs on both whatever was imported first.

Numerics, shared by all kernels:

* every load is converted to the accumulation type ``ACC`` right away (fp32, fp64 for fp64): bf16 arithmetic
  inside an interpreted kernel is wrong, and the GPU gains nothing from half-precision math here;
* fp32 quotients use ``tl.div_rn`` (IEEE round-to-nearest; Triton's ``/`` is an approximate division on the
  GPU) and the launchers pass ``enable_fp_fusion=False``, so no multiply-add is contracted into an FMA: IoUs
  and RoIAlign sums are the ones the C++ CPU kernels (and torchvision's CPU kernels) compute, bit for bit;
* ``min``/``max`` are written as the C++ ``std::min``/``std::max`` selects, so NaN flows the same way;
* integer offsets are formed in int64 (tensors past 2^31 elements).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _div(a, b, FP64: tl.constexpr):
    """IEEE round-to-nearest quotient."""
    if FP64:
        return a / b
    else:
        return tl.div_rn(a, b)


@triton.jit
def _i64(v):
    """v as an int64 scalar (loop indices are plain ints under the interpreter, int32 when compiled)."""
    return tl.full([], 0, tl.int64) + v


@triton.jit
def _sum(x, axis):
    """``tl.sum``, callable from the interpreted copy of this module too.

    ``tl.sum`` is itself a ``@triton.jit`` function, so when triton was imported without TRITON_INTERPRET=1
    (as in any process that imported torch first) an interpreted kernel cannot call it. ``tl.reduce`` is a
    builtin, and with triton's own ``_sum_combine`` the interpreter reduces with ``np.sum`` instead of element
    by element; compiled, this is exactly what ``tl.sum`` does (checked with triton 3.8, the version torch
    2.14 pins). For the same reason the kernels use ``tl.full`` where ``tl.zeros`` (also ``@triton.jit``)
    would do.
    """
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _flag(condition):
    """A comparison result that can be broadcast safely: the interpreter labels a float comparison's result
    with the float type, and splatting such a scalar turns it into floats that ``&`` then rejects.
    """
    return tl.where(condition, 1, 0) != 0


@triton.jit
def _cpp_min(a, b):
    return tl.where(b < a, b, a)  # std::min(a, b): (b < a) ? b : a


@triton.jit
def _cpp_max(a, b):
    return tl.where(a < b, b, a)  # std::max(a, b): (a < b) ? b : a


@triton.jit
def _pair_iou(ax1, ay1, ax2, ay2, a_area, bx1, by1, bx2, by2, b_area, FP64: tl.constexpr, INT: tl.constexpr):
    """IoU of broadcast box pairs; 0 where the union is not > 0 or the ratio is NaN (never NaN)."""
    w = _cpp_max(0, _cpp_min(ax2, bx2) - _cpp_max(ax1, bx1))
    h = _cpp_max(0, _cpp_min(ay2, by2) - _cpp_max(ay1, by1))
    inter = w * h
    union = a_area + b_area - inter
    positive = union > 0
    if INT:
        # integer boxes: exact int64 areas, then one fp32 division as torch's int / int does
        iou = tl.div_rn(inter.to(tl.float32), tl.where(positive, union, 1).to(tl.float32))
    else:
        iou = _div(inter, tl.where(positive, union, 1), FP64)
    return tl.where(positive & (iou == iou), iou, 0)


@triton.jit
def box_iou_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    n,
    m,
    sa0,
    sa1,
    sb0,
    sb1,
    ACC: tl.constexpr,
    FP64: tl.constexpr,
    INT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """out[i, j] = IoU(a[i], b[j]); one [BLOCK_N, BLOCK_M] tile per program."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    mn = rn < n
    mm = rm < m
    a = a_ptr + rn.to(tl.int64) * sa0
    b = b_ptr + rm.to(tl.int64) * sb0
    ax1 = tl.load(a, mask=mn, other=0).to(ACC)
    ay1 = tl.load(a + sa1, mask=mn, other=0).to(ACC)
    ax2 = tl.load(a + 2 * sa1, mask=mn, other=0).to(ACC)
    ay2 = tl.load(a + 3 * sa1, mask=mn, other=0).to(ACC)
    bx1 = tl.load(b, mask=mm, other=0).to(ACC)
    by1 = tl.load(b + sb1, mask=mm, other=0).to(ACC)
    bx2 = tl.load(b + 2 * sb1, mask=mm, other=0).to(ACC)
    by2 = tl.load(b + 3 * sb1, mask=mm, other=0).to(ACC)
    a_area = (ax2 - ax1) * (ay2 - ay1)
    b_area = (bx2 - bx1) * (by2 - by1)
    iou = _pair_iou(
        ax1[:, None],
        ay1[:, None],
        ax2[:, None],
        ay2[:, None],
        a_area[:, None],
        bx1[None, :],
        by1[None, :],
        bx2[None, :],
        by2[None, :],
        b_area[None, :],
        FP64,
        INT,
    )
    out = out_ptr + rn.to(tl.int64)[:, None] * m + rm[None, :]
    tl.store(out, iou.to(out_ptr.dtype.element_ty), mask=mn[:, None] & mm[None, :])


@triton.jit
def nms_mask_kernel(
    boxes_ptr,
    s0,
    s1,
    order_ptr,
    cls_ptr,
    thr_ptr,
    mask_ptr,
    n,
    words,
    band,
    ACC: tl.constexpr,
    FP64: tl.constexpr,
):
    """IoU bitmask of the boxes in visiting order, banded: bit t of mask[i, d] says "box i suppresses box
    64 (i // 64 + d) + t". Boxes are grouped by class (ascending), and no class spans more than ``band`` words
    past its first, so row i needs only the words [i // 64, i // 64 + band).

    One 64 x 64 tile per program, grid (band, words): tile (rb, rb + d). A tile is computed only if it holds a
    pair of the same class, i.e. iff the class of its last row is >= that of its first column (always so on
    the diagonal); the greedy pass never reads the others (a kept row is read only up to the end of its
    class).
    """
    rb = tl.program_id(1)
    cb = rb + tl.program_id(0)
    if cb < words:
        last_row = tl.minimum(rb * 64 + 63, n - 1)
        if tl.load(cls_ptr + last_row) >= tl.load(cls_ptr + cb * 64):
            lane = tl.arange(0, 64)
            r = rb * 64 + lane
            c = cb * 64 + lane
            rmask = r < n
            cmask = c < n
            ri = tl.load(order_ptr + r, mask=rmask, other=0) * s0
            ci = tl.load(order_ptr + c, mask=cmask, other=0) * s0
            rx1 = tl.load(boxes_ptr + ri, mask=rmask, other=0).to(ACC)
            ry1 = tl.load(boxes_ptr + ri + s1, mask=rmask, other=0).to(ACC)
            rx2 = tl.load(boxes_ptr + ri + 2 * s1, mask=rmask, other=0).to(ACC)
            ry2 = tl.load(boxes_ptr + ri + 3 * s1, mask=rmask, other=0).to(ACC)
            cx1 = tl.load(boxes_ptr + ci, mask=cmask, other=0).to(ACC)
            cy1 = tl.load(boxes_ptr + ci + s1, mask=cmask, other=0).to(ACC)
            cx2 = tl.load(boxes_ptr + ci + 2 * s1, mask=cmask, other=0).to(ACC)
            cy2 = tl.load(boxes_ptr + ci + 3 * s1, mask=cmask, other=0).to(ACC)
            r_area = (rx2 - rx1) * (ry2 - ry1)
            c_area = (cx2 - cx1) * (cy2 - cy1)
            iou = _pair_iou(
                rx1[:, None],
                ry1[:, None],
                rx2[:, None],
                ry2[:, None],
                r_area[:, None],
                cx1[None, :],
                cy1[None, :],
                cx2[None, :],
                cy2[None, :],
                c_area[None, :],
                FP64,
                False,
            )
            r_cls = tl.load(cls_ptr + r, mask=rmask, other=0)
            c_cls = tl.load(cls_ptr + c, mask=cmask, other=0)
            # fp32 IoU against the double threshold, as torchvision's CPU kernel compares them
            threshold = tl.load(thr_ptr)
            hit = (
                (iou.to(tl.float64) > threshold)
                & (r_cls[:, None] == c_cls[None, :])
                & (c[None, :] > r[:, None])
                & cmask[None, :]
            )
            one = tl.full([64, 64], 1, tl.int64)
            # distinct powers of two: their sum is their OR (bit 63 wraps to the sign bit, as intended)
            bits = _sum(tl.where(hit, one << lane.to(tl.int64)[None, :], 0), axis=1)
            tl.store(mask_ptr + r.to(tl.int64) * band + (cb - rb), bits, mask=rmask)


@triton.jit
def nms_greedy_kernel(
    mask_ptr, removed_ptr, cls_ptr, class_end_ptr, keep_ptr, n, words, band, limit, WORDS_BLOCK: tl.constexpr
):
    """The greedy pass, one program: boxes in visiting order (grouped by class, each class by score).

    Box i is kept unless it starts removed (``removed_ptr``: one int64 of bits per word, set for boxes that
    must not take part, and for the padding past n) or a kept box of its class suppressed it, and at most
    ``limit`` boxes per class are kept (a class never needs more: the global result is truncated at
    ``limit``). The removed bits of all boxes live in registers, a word whose boxes are all removed is skipped
    in one test, and the mask is read only for kept rows, up to the end of their class. Writes keep[i] = 1 for
    kept boxes.
    """
    word_ids = tl.arange(0, WORDS_BLOCK)
    lane = tl.arange(0, 64)
    removed = tl.load(removed_ptr + word_ids, mask=word_ids < words, other=-1)
    kept_in_class = 0
    current_class = tl.load(cls_ptr)
    for w in range(0, words):
        cur = _sum(tl.where(word_ids == w, removed, 0), 0)
        if cur != -1:
            rows = w * 64 + lane
            rmask = rows < n
            diag = tl.load(mask_ptr + rows.to(tl.int64) * band, mask=rmask, other=0)
            row_cls = tl.load(cls_ptr + rows, mask=rmask, other=0)
            row_end = (tl.load(class_end_ptr + rows, mask=rmask, other=0) + 63) // 64
            for t in range(0, 64):
                i = w * 64 + t
                # a removed box costs one bit test; its class matters only to the next box that survives
                if (((cur >> t) & 1) == 0) & (i < n):
                    c = _sum(tl.where(lane == t, row_cls, 0), 0)
                    if c != current_class:
                        current_class = c
                        kept_in_class = 0
                    if kept_in_class < limit:
                        kept_in_class += 1
                        cur = cur | _sum(tl.where(lane == t, diag, 0), 0)
                        tl.store(keep_ptr + i, 1)
                        end = _sum(tl.where(lane == t, row_end, 0), 0)
                        later = (word_ids > w) & (word_ids < end) & (word_ids < w + band)
                        row = tl.load(mask_ptr + _i64(i) * band + (word_ids - w), mask=later, other=0)
                        removed = removed | row


@triton.jit
def _axis_taps(start, bin_size, bin_index, s, grid, size, ACC: tl.constexpr, FP64: tl.constexpr):
    """Bilinear taps of sample ``s`` of bins ``bin_index`` along one axis (torchvision's arithmetic).

    Returns (valid, low, high, weight of low, weight of high); invalid samples lie outside [-1, size].
    """
    pos = start + bin_index.to(ACC) * bin_size + _div((s + 0.5) * bin_size, grid.to(ACC), FP64)
    valid = (pos >= -1) & (pos <= size)  # the launchers never pass an empty map
    pos = tl.where(pos <= 0, 0, pos)
    low = tl.where(valid, pos, 0).to(tl.int32)
    at_edge = low >= size - 1
    low = tl.where(at_edge, size - 1, low)
    high = tl.where(at_edge, size - 1, low + 1)
    pos = tl.where(at_edge, low.to(ACC), pos)
    frac = pos - low.to(ACC)
    return valid, low, high, 1 - frac, frac


@triton.jit
def _roi_geometry(
    rois_ptr,
    sr0,
    sr1,
    k,
    scale_ptr,
    batch,
    pooled_h,
    pooled_w,
    sampling_ratio,
    ALIGNED: tl.constexpr,
    ACC: tl.constexpr,
    FP64: tl.constexpr,
):
    """Image index (and whether it is in [0, N)), start, bin size and sample grid of roi k."""
    roi = rois_ptr + _i64(k) * sr0
    b = tl.load(roi).to(ACC)
    in_batch = _flag((b > -1) & (b < batch))  # truncated toward zero, the index lands in [0, N)
    image = tl.where(in_batch, b, 0).to(tl.int64)
    scale = tl.load(scale_ptr).to(ACC)
    offset = 0.5 if ALIGNED else 0.0
    start_w = tl.load(roi + sr1).to(ACC) * scale - offset
    start_h = tl.load(roi + 2 * sr1).to(ACC) * scale - offset
    roi_w = (tl.load(roi + 3 * sr1).to(ACC) * scale - offset) - start_w
    roi_h = (tl.load(roi + 4 * sr1).to(ACC) * scale - offset) - start_h
    if not ALIGNED:  # legacy: malformed rois are forced to at least 1 x 1
        roi_w = _cpp_max(roi_w, 1)
        roi_h = _cpp_max(roi_h, 1)
    bin_h = _div(roi_h, pooled_h.to(ACC), FP64)
    bin_w = _div(roi_w, pooled_w.to(ACC), FP64)
    if sampling_ratio > 0:
        grid_h = sampling_ratio + 0 * pooled_h
        grid_w = sampling_ratio + 0 * pooled_w
    else:
        gh = tl.ceil(_div(roi_h, pooled_h.to(ACC), FP64))
        gw = tl.ceil(_div(roi_w, pooled_w.to(ACC), FP64))
        # NaN or non-positive sizes give no samples; the cap keeps the conversion defined
        grid_h = tl.where(gh > 0, tl.minimum(gh, 1073741824.0), 0).to(tl.int32)
        grid_w = tl.where(gw > 0, tl.minimum(gw, 1073741824.0), 0).to(tl.int32)
    count = tl.maximum(grid_h * grid_w, 1).to(ACC)
    return in_batch, image, start_h, start_w, bin_h, bin_w, grid_h, grid_w, count


@triton.jit
def _owns(levels_ptr, k, level, num_levels, HAS_LEVELS: tl.constexpr):
    """Whether this launch (one per level) handles roi k; launch 0 also takes rois with an invalid level."""
    if HAS_LEVELS:
        lvl = tl.load(levels_ptr + k)
        return (lvl == level) | ((level == 0) & ((lvl < 0) | (lvl >= num_levels)))
    else:
        return _i64(k) >= 0


@triton.jit
def _level_ok(levels_ptr, k, num_levels, HAS_LEVELS: tl.constexpr):
    if HAS_LEVELS:
        lvl = tl.load(levels_ptr + k)
        return (lvl >= 0) & (lvl < num_levels)
    else:
        return _i64(k) >= 0


@triton.jit(do_not_specialize=["pooled_h", "pooled_w", "sampling_ratio"])
def roi_align_forward_kernel(
    x_ptr,
    rois_ptr,
    levels_ptr,
    scale_ptr,
    out_ptr,
    level,
    num_levels,
    batch,
    channels,
    height,
    width,
    sx_n,
    sx_c,
    sx_h,
    sx_w,
    sr0,
    sr1,
    so_k,
    so_c,
    so_h,
    so_w,
    pooled_h,
    pooled_w,
    sampling_ratio,
    ALIGNED: tl.constexpr,
    HAS_LEVELS: tl.constexpr,
    ACC: tl.constexpr,
    FP64: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """out[k, c, ph, pw] for roi k and a block of channels, all bins at once; grid (K, cdiv(C, BLOCK_C)).

    Reads x through its strides (contiguous or channels_last), sums samples in ACC in torchvision's order,
    writes through the output's strides. A roi with an image index outside [0, N) (or an invalid level) pools
    to zeros.
    """
    k = tl.program_id(0)
    if _owns(levels_ptr, k, level, num_levels, HAS_LEVELS):
        in_batch, image, start_h, start_w, bin_h, bin_w, grid_h, grid_w, count = _roi_geometry(
            rois_ptr, sr0, sr1, k, scale_ptr, batch, pooled_h, pooled_w, sampling_ratio, ALIGNED, ACC, FP64
        )
        in_batch = in_batch & _level_ok(levels_ptr, k, num_levels, HAS_LEVELS)
        p = tl.arange(0, BLOCK_P)
        bin_y = p // pooled_w
        bin_x = p % pooled_w
        pmask = p < pooled_h * pooled_w
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < channels
        base = x_ptr + image * sx_n + c.to(tl.int64)[None, :] * sx_c
        acc = tl.full([BLOCK_P, BLOCK_C], 0, ACC)
        for iy in range(0, grid_h):
            y_ok, y_lo, y_hi, wy_lo, wy_hi = _axis_taps(start_h, bin_h, bin_y, iy, grid_h, height, ACC, FP64)
            for ix in range(0, grid_w):
                x_ok, x_lo, x_hi, wx_lo, wx_hi = _axis_taps(
                    start_w, bin_w, bin_x, ix, grid_w, width, ACC, FP64
                )
                ok = (y_ok & x_ok & pmask & in_batch)[:, None] & cmask[None, :]
                y0 = y_lo.to(tl.int64) * sx_h
                y1 = y_hi.to(tl.int64) * sx_h
                x0 = x_lo.to(tl.int64) * sx_w
                x1 = x_hi.to(tl.int64) * sx_w
                v1 = tl.load(base + (y0 + x0)[:, None], mask=ok, other=0).to(ACC)
                v2 = tl.load(base + (y0 + x1)[:, None], mask=ok, other=0).to(ACC)
                v3 = tl.load(base + (y1 + x0)[:, None], mask=ok, other=0).to(ACC)
                v4 = tl.load(base + (y1 + x1)[:, None], mask=ok, other=0).to(ACC)
                w1 = (wy_lo * wx_lo)[:, None]
                w2 = (wy_lo * wx_hi)[:, None]
                w3 = (wy_hi * wx_lo)[:, None]
                w4 = (wy_hi * wx_hi)[:, None]
                acc = acc + (w1 * v1 + w2 * v2 + w3 * v3 + w4 * v4)
        value = _div(acc, count, FP64)
        out = (
            out_ptr
            + k.to(tl.int64) * so_k
            + c.to(tl.int64)[None, :] * so_c
            + (bin_y.to(tl.int64) * so_h + bin_x.to(tl.int64) * so_w)[:, None]
        )
        tl.store(out, value.to(out_ptr.dtype.element_ty), mask=pmask[:, None] & cmask[None, :])


@triton.jit(do_not_specialize=["pooled_h", "pooled_w", "sampling_ratio"])
def roi_align_backward_atomic_kernel(
    grad_ptr,
    rois_ptr,
    levels_ptr,
    scale_ptr,
    gx_ptr,
    level,
    num_levels,
    batch,
    channels,
    height,
    width,
    sg_k,
    sg_c,
    sg_h,
    sg_w,
    sr0,
    sr1,
    sx_n,
    sx_c,
    sx_h,
    sx_w,
    pooled_h,
    pooled_w,
    sampling_ratio,
    ALIGNED: tl.constexpr,
    HAS_LEVELS: tl.constexpr,
    ACC: tl.constexpr,
    FP64: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Scatters grad[k] into the ACC buffer gx with atomic adds; grid (K, cdiv(C, BLOCK_C)).

    Rois overlap, so two programs may add into the same pixel: the order of those fp32 additions is not
    fixed, hence not bit-reproducible run to run (see the deterministic kernel below).
    """
    k = tl.program_id(0)
    if _owns(levels_ptr, k, level, num_levels, HAS_LEVELS):
        in_batch, image, start_h, start_w, bin_h, bin_w, grid_h, grid_w, count = _roi_geometry(
            rois_ptr, sr0, sr1, k, scale_ptr, batch, pooled_h, pooled_w, sampling_ratio, ALIGNED, ACC, FP64
        )
        in_batch = in_batch & _level_ok(levels_ptr, k, num_levels, HAS_LEVELS)
        p = tl.arange(0, BLOCK_P)
        bin_y = p // pooled_w
        bin_x = p % pooled_w
        pmask = p < pooled_h * pooled_w
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = c < channels
        g_ptr = (
            grad_ptr
            + k.to(tl.int64) * sg_k
            + c.to(tl.int64)[None, :] * sg_c
            + (bin_y.to(tl.int64) * sg_h + bin_x.to(tl.int64) * sg_w)[:, None]
        )
        g = _div(tl.load(g_ptr, mask=pmask[:, None] & cmask[None, :], other=0).to(ACC), count, FP64)
        base = gx_ptr + image * sx_n + c.to(tl.int64)[None, :] * sx_c
        for iy in range(0, grid_h):
            y_ok, y_lo, y_hi, wy_lo, wy_hi = _axis_taps(start_h, bin_h, bin_y, iy, grid_h, height, ACC, FP64)
            for ix in range(0, grid_w):
                x_ok, x_lo, x_hi, wx_lo, wx_hi = _axis_taps(
                    start_w, bin_w, bin_x, ix, grid_w, width, ACC, FP64
                )
                ok = (y_ok & x_ok & pmask & in_batch)[:, None] & cmask[None, :]
                y0 = y_lo.to(tl.int64) * sx_h
                y1 = y_hi.to(tl.int64) * sx_h
                x0 = x_lo.to(tl.int64) * sx_w
                x1 = x_hi.to(tl.int64) * sx_w
                tl.atomic_add(base + (y0 + x0)[:, None], g * (wy_lo * wx_lo)[:, None], mask=ok, sem="relaxed")
                tl.atomic_add(base + (y0 + x1)[:, None], g * (wy_lo * wx_hi)[:, None], mask=ok, sem="relaxed")
                tl.atomic_add(base + (y1 + x0)[:, None], g * (wy_hi * wx_lo)[:, None], mask=ok, sem="relaxed")
                tl.atomic_add(base + (y1 + x1)[:, None], g * (wy_hi * wx_hi)[:, None], mask=ok, sem="relaxed")


@triton.jit
def _axis_tap(start, bin_size, bin_index, s, grid, size, ACC: tl.constexpr, FP64: tl.constexpr):
    """Scalar form of :func:`_axis_taps` (one bin, one sample)."""
    pos = start + bin_index.to(ACC) * bin_size + _div((s + 0.5) * bin_size, grid.to(ACC), FP64)
    valid = _flag((pos >= -1) & (pos <= size))  # the launchers never pass an empty map
    pos = tl.where(pos <= 0, 0, pos)
    low = tl.where(valid, pos, 0).to(tl.int32)
    at_edge = low >= size - 1
    low = tl.where(at_edge, size - 1, low)
    high = tl.where(at_edge, size - 1, low + 1)
    pos = tl.where(at_edge, low.to(ACC), pos)
    frac = pos - low.to(ACC)
    return valid, low, high, 1 - frac, frac


@triton.jit
def _add_corner(ptr, value, mask):
    tl.store(ptr, tl.load(ptr, mask=mask, other=0) + value, mask=mask)


@triton.jit
def _bins_reaching(first, end, start, bin_size, pooled):
    """[lo, hi) of the bins along one axis whose samples can land on pixels [first, end): bin b's samples lie
    in [start + b * bin_size, start + (b + 1) * bin_size] and reach floor(pos) and floor(pos) + 1, clamped
    into the map; two bins of slack each side absorb rounding. Every bin when start or bin_size is not finite
    or bin_size <= 0.
    """
    narrow = (bin_size > 0) & (bin_size < 1.0e30) & (start > -1.0e30) & (start < 1.0e30)  # NaN fails all
    safe_size = tl.where(narrow, bin_size, 1.0)
    safe_start = tl.where(narrow, start, 0.0)
    lo = tl.floor((first - 1 - safe_start) / safe_size) - 2
    hi = tl.floor((end - safe_start) / safe_size) + 3
    lo = tl.minimum(tl.minimum(tl.maximum(lo, 0.0), 1.0e9).to(tl.int32), pooled)
    hi = tl.minimum(tl.minimum(tl.maximum(hi, 0.0), 1.0e9).to(tl.int32), pooled)
    return tl.where(narrow, lo, 0), tl.where(narrow, hi, pooled)


@triton.jit(do_not_specialize=["pooled_h", "pooled_w", "sampling_ratio", "tile_h", "tile_w"])
def roi_align_backward_owned_kernel(
    grad_ptr,
    rois_ptr,
    levels_ptr,
    scale_ptr,
    gx_ptr,
    level,
    num_levels,
    num_rois,
    batch,
    channels,
    height,
    width,
    sg_k,
    sg_c,
    sg_h,
    sg_w,
    sr0,
    sr1,
    sx_n,
    sx_c,
    sx_h,
    sx_w,
    pooled_h,
    pooled_w,
    sampling_ratio,
    tile_h,
    tile_w,
    ALIGNED: tl.constexpr,
    HAS_LEVELS: tl.constexpr,
    ACC: tl.constexpr,
    FP64: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Deterministic backward: each program owns a tile_h x tile_w tile of one image's gx for a block of
    channels and adds into it, in one fixed order (roi, bin, sample, corner), every contribution that lands in
    the tile, as the CPU kernel's threads own channels. No two programs write the same element, so no atomics,
    and every element's sum has the serial kernel's order whatever the tiling; grid (N * tiles, cdiv(C,
    BLOCK_C)).

    Each program checks every RoI (a few scalar loads) and walks only the bins that reach its tile, so the
    work is the atomic kernel's plus that check and the bins straddling tile edges; it runs when
    ``torch.use_deterministic_algorithms(True)`` is on.
    """
    tiles_w = (width + tile_w - 1) // tile_w
    tiles = (height + tile_h - 1) // tile_h * tiles_w
    n = tl.program_id(0) // tiles
    tile = tl.program_id(0) % tiles
    y_first = (tile // tiles_w) * tile_h
    x_first = (tile % tiles_w) * tile_w
    y_end = y_first + tile_h
    x_end = x_first + tile_w
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < channels
    base = gx_ptr + n.to(tl.int64) * sx_n + c.to(tl.int64) * sx_c
    for k in range(0, num_rois):
        mine = _owns(levels_ptr, k, level, num_levels, HAS_LEVELS) & _level_ok(
            levels_ptr, k, num_levels, HAS_LEVELS
        )
        in_batch, image, start_h, start_w, bin_h, bin_w, grid_h, grid_w, count = _roi_geometry(
            rois_ptr, sr0, sr1, k, scale_ptr, batch, pooled_h, pooled_w, sampling_ratio, ALIGNED, ACC, FP64
        )
        if mine & in_batch & (image == n):
            by_lo, by_hi = _bins_reaching(y_first, y_end, start_h, bin_h, pooled_h)
            bx_lo, bx_hi = _bins_reaching(x_first, x_end, start_w, bin_w, pooled_w)
            for y_bin in range(by_lo, by_hi):
                bin_y = _i64(y_bin)
                for x_bin in range(bx_lo, bx_hi):
                    bin_x = _i64(x_bin)
                    g_ptr = grad_ptr + _i64(k) * sg_k + c.to(tl.int64) * sg_c + bin_y * sg_h + bin_x * sg_w
                    g = _div(tl.load(g_ptr, mask=cmask, other=0).to(ACC), count, FP64)
                    for iy in range(0, grid_h):
                        y_ok, y_lo, y_hi, wy_lo, wy_hi = _axis_tap(
                            start_h, bin_h, bin_y, iy, grid_h, height, ACC, FP64
                        )
                        lo_row = (y_lo >= y_first) & (y_lo < y_end)
                        hi_row = (y_hi >= y_first) & (y_hi < y_end)
                        for ix in range(0, grid_w):
                            x_ok, x_lo, x_hi, wx_lo, wx_hi = _axis_tap(
                                start_w, bin_w, bin_x, ix, grid_w, width, ACC, FP64
                            )
                            ok = cmask & y_ok & x_ok
                            lo_col = (x_lo >= x_first) & (x_lo < x_end)
                            hi_col = (x_hi >= x_first) & (x_hi < x_end)
                            y0 = y_lo.to(tl.int64) * sx_h
                            y1 = y_hi.to(tl.int64) * sx_h
                            x0 = x_lo.to(tl.int64) * sx_w
                            x1 = x_hi.to(tl.int64) * sx_w
                            _add_corner(base + y0 + x0, g * (wy_lo * wx_lo), ok & lo_row & lo_col)
                            _add_corner(base + y0 + x1, g * (wy_lo * wx_hi), ok & lo_row & hi_col)
                            _add_corner(base + y1 + x0, g * (wy_hi * wx_lo), ok & hi_row & lo_col)
                            _add_corner(base + y1 + x1, g * (wy_hi * wx_hi), ok & hi_row & hi_col)

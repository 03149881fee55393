"""Non-maximum suppression that stops as soon as it has kept enough boxes.

The RPN keeps only the ``post_nms_top_n`` best proposals and the detector only ``detections_per_img``
boxes after NMS, yet torchvision's NMS always runs to the end and the caller slices afterwards. With
``max_output`` the greedy pass stops at the k-th kept box, which is where most of its time went
(TVM folded this "top-k after NMS" into NMS' ``max_output_size`` for the same reason).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_amp_det.ops import reference
from lit_amp_det.ops._extension import extension_available, has_kernel

__all__ = ["batched_nms", "batched_nms_padded", "nms"]


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float, max_output: int = -1) -> Tensor:
    """Greedy non-maximum suppression.

    Scriptable with ``torch.jit.script`` when the compiled extension is loaded, like torchvision's.

    Args:
        boxes (Tensor[N, 4]): ``(x1, y1, x2, y2)`` boxes, any float dtype (IoU is computed in fp32, fp64 for
            fp64).
        scores (Tensor[N]): scores, any float dtype.
        iou_threshold (float): a box is dropped when a kept box overlaps it with IoU strictly greater than
            this.
        max_output (int): stop once this many boxes are kept; negative keeps all survivors. Default: -1.

    Returns:
        Tensor[M] (int64): indices of the kept boxes in decreasing score order (ties: lower index first),
        equal to the first ``max_output`` of the unlimited result; empty when ``boxes`` is.

    Raises:
        RuntimeError: on the CPU (compiled kernel), if ``boxes`` is not ``[N, 4]``, ``scores`` is not ``[N]``,
            they are on different devices, or either is not float16, bfloat16, float32 or float64.
        ValueError: on CUDA (Triton kernels), for a wrong shape or device, or more boxes than one call takes.
        TypeError: on CUDA (Triton kernels), for a dtype other than float16, bfloat16, float32 or float64.
    """
    if torch.jit.is_scripting():  # TorchScript compiles this branch only
        return torch.ops.lit_amp_det.nms(boxes, scores, iou_threshold, max_output)
    if _is_empty(boxes):
        return _no_boxes(boxes)
    if has_kernel("nms", boxes.device):
        return torch.ops.lit_amp_det.nms(boxes, scores, float(iou_threshold), int(max_output))
    return reference.nms(boxes, scores, iou_threshold, max_output)


def batched_nms(
    boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float, max_output: int = -1
) -> Tensor:
    """Non-maximum suppression within each category of ``idxs``, with one global ``max_output``.

    Args:
        boxes (Tensor[N, 4]): ``(x1, y1, x2, y2)`` boxes.
        scores (Tensor[N]): scores.
        idxs (Tensor[N]): integer category of each box (class label, or FPN level in the RPN); boxes of
            different categories never suppress each other.
        iou_threshold: IoU above which a lower-scored box of the same category is dropped.
        max_output: stop once this many boxes are kept over all categories; negative keeps all.

    Returns:
        Tensor[M] (int64): kept indices in decreasing score order (ties: lower index first); empty when
        ``boxes`` is, whatever ``scores`` and ``idxs`` hold (as torchvision).
    """
    if torch.jit.is_scripting():  # TorchScript compiles this branch only
        return torch.ops.lit_amp_det.batched_nms(boxes, scores, idxs, iou_threshold, max_output)
    if _is_empty(boxes):  # like torchvision: whatever the other arguments hold
        return _no_boxes(boxes)
    if has_kernel("batched_nms", boxes.device):
        return torch.ops.lit_amp_det.batched_nms(boxes, scores, idxs, float(iou_threshold), int(max_output))
    return reference.batched_nms(boxes, scores, idxs, iou_threshold, max_output)


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
    """:func:`batched_nms` with a result of fixed size, so that the caller never waits for the device.

    Args:
        boxes (Tensor[N, 4]): ``(x1, y1, x2, y2)`` boxes, any float dtype.
        scores (Tensor[N]): scores, any float dtype.
        idxs (Tensor[N]): integer category of each box (class label, or FPN level in the RPN); boxes of
            different categories never suppress each other.
        iou_threshold (float): IoU above which a lower-scored box of the same category is dropped.
        max_output (int): the most boxes kept over all categories, and the length of ``keep``; negative
            keeps all. Default: -1.
        valid (Tensor[N], bool, optional): the boxes to consider; the others are neither kept nor suppress
            anything (a score or size filter applied without a gather of data-dependent size). Default:
            ``None`` (all boxes).
        max_class_size (int, optional): an upper bound on any one class's box count, when the caller knows it
            (the RPN's per-level top-k); the CUDA kernel then sizes its IoU mask by it. A class larger than
            the bound gives wrong results there. Default: ``None`` (no bound).

    Returns:
        (keep, count): ``keep`` is ``Tensor[L]`` int64 with ``L = min(N, max_output)`` (``N`` when
        ``max_output < 0``), the kept indices in decreasing score order followed by ``-1`` padding; ``count``
        is a 0-d int64 tensor on the boxes' device, the number kept (``keep[:count]`` is :func:`batched_nms`
        of the valid boxes).

    Raises:
        RuntimeError: on the CPU (compiled kernel), if ``boxes``, ``scores`` or ``idxs`` has the wrong shape,
            dtype or device, or ``valid`` is not a bool ``Tensor[N]`` on the boxes' device.
        ValueError: on CUDA (Triton kernels), for a wrong shape or device (``valid`` included), or more
            boxes than one call takes.
        TypeError: on CUDA (Triton kernels), if ``boxes`` or ``scores`` is not a float tensor or ``idxs`` not
            an integer one.
    """
    bound = -1 if max_class_size is None else int(max_class_size)
    if has_kernel("batched_nms_padded", boxes.device):
        return torch.ops.lit_amp_det.batched_nms_padded(
            boxes, scores, idxs, valid, float(iou_threshold), int(max_output), bound
        )
    return reference.batched_nms_padded(boxes, scores, idxs, iou_threshold, max_output, valid)


def _is_empty(boxes: Tensor) -> bool:
    """``boxes`` holds no box, decided only for concrete sizes (a symbolic one must not be specialised)."""
    numel = boxes.numel()
    return isinstance(numel, int) and numel == 0


def _no_boxes(boxes: Tensor) -> Tensor:
    return torch.empty((0,), dtype=torch.int64, device=boxes.device)


def _fake_kept_indices(boxes: Tensor, scores: Tensor, max_output: int) -> Tensor:
    torch._check(
        boxes.dim() == 2 and boxes.shape[-1] == 4, lambda: f"boxes must be [N, 4], got {tuple(boxes.shape)}"
    )
    torch._check(scores.dim() == 1, lambda: f"scores must be [N], got {tuple(scores.shape)}")
    torch._check(scores.shape[0] == boxes.shape[0], lambda: "boxes and scores must have the same length")
    kept = torch.library.get_ctx().new_dynamic_size()
    torch._check(kept <= boxes.shape[0])
    if max_output >= 0:
        torch._check(kept <= max_output)
    return boxes.new_empty((kept,), dtype=torch.int64)


if extension_available():

    @torch.library.register_fake("lit_amp_det::nms")
    def _nms_fake(boxes: Tensor, scores: Tensor, iou_threshold: float, max_output: int = -1) -> Tensor:
        return _fake_kept_indices(boxes, scores, max_output)

    @torch.library.register_fake("lit_amp_det::batched_nms")
    def _batched_nms_fake(
        boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float, max_output: int = -1
    ) -> Tensor:
        torch._check(idxs.shape == scores.shape, lambda: "idxs must have one entry per box")
        return _fake_kept_indices(boxes, scores, max_output)

    @torch.library.register_fake("lit_amp_det::batched_nms_padded")
    def _batched_nms_padded_fake(
        boxes: Tensor,
        scores: Tensor,
        idxs: Tensor,
        valid: Tensor | None,
        iou_threshold: float,
        max_output: int = -1,
        max_class_size: int = -1,
    ) -> tuple[Tensor, Tensor]:
        torch._check(idxs.shape == scores.shape, lambda: "idxs must have one entry per box")
        n = boxes.shape[0]
        limit = n if max_output < 0 else min(n, max_output)
        return boxes.new_empty((limit,), dtype=torch.int64), boxes.new_empty((), dtype=torch.int64)

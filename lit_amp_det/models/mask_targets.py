"""Mask R-CNN's mask targets and mask loss with one RoIAlign call for the batch, on lit_amp_det's RoIAlign.

torchvision's ``maskrcnn_loss`` builds the targets image by image: ``project_masks_on_boxes`` casts that
image's ground-truth masks to float and crops every positive proposal's matched mask with torchvision's
``roi_align``, so a batch of B images makes B RoIAlign calls, B mask casts and a concatenation. Here the masks
of all images of one size are concatenated into one ``[sum M_i, 1, H, W]`` tensor, each positive proposal's
RoI indexes its matched mask in it (``offset_i + matched_idx``), and :func:`lit_amp_det.ops.roi_align` crops
them all at once, writing the targets straight in batch order. Images of different sizes (RoIAlign clamps
samples at each mask's own border, so padding them to one size would change the crops at the border) take one
call per size: one call for the usual fixed-size batch. The numbers are torchvision's (same RoIs, same
RoIAlign semantics).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lit_amp_det.models.detection_core import mask_head_loss
from lit_amp_det.ops import roi_align

__all__ = ["maskrcnn_loss", "positive_labels", "project_masks_on_boxes"]


def _rois(proposals: Sequence[Tensor], matched_idxs: Sequence[Tensor], offsets: Sequence[int]) -> Tensor:
    """``[sum K_i, 5]`` RoIs ``(offset_i + matched index, x1, y1, x2, y2)`` in the proposals' dtype."""
    return torch.cat(
        [
            torch.cat([(idxs + offset).to(boxes.dtype)[:, None], boxes], dim=1)
            for boxes, idxs, offset in zip(proposals, matched_idxs, offsets)
        ]
    )


def _project_group(
    gt_masks: Sequence[Tensor], proposals: Sequence[Tensor], matched_idxs: Sequence[Tensor], size: int
) -> Tensor:
    """The targets of images whose masks share one size, in image order: one RoIAlign call."""
    counts = [m.shape[0] for m in gt_masks]
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    rois = _rois(proposals, matched_idxs, offsets)
    masks = torch.cat(list(gt_masks))[:, None].to(rois.dtype)
    return roi_align(masks, rois, (size, size), 1.0)[:, 0]


def project_masks_on_boxes(
    gt_masks: Sequence[Tensor], proposals: Sequence[Tensor], matched_idxs: Sequence[Tensor], size: int
) -> Tensor:
    """Every image's matched ground-truth masks cropped to its proposals and resized, as one tensor.

    Args:
        gt_masks (List[Tensor[M_i, H_i, W_i]]): each image's instance masks (uint8, bool or float). proposals
        (List[Tensor[K_i, 4]]): each image's positive proposals ``(x1, y1, x2, y2)``, float. matched_idxs
        (List[Tensor[K_i]], int64): index into that image's masks of each proposal's ground truth. size: side
        of the square targets (the mask head's output size).

    Returns:
        Tensor[sum K_i, size, size] in the proposals' dtype: row ``k`` is what torchvision's
        ``project_masks_on_boxes`` gives for the ``k``-th proposal in image order. Images without proposals
        (no positives, or no ground truth) contribute no rows.
    """
    if not (len(gt_masks) == len(proposals) == len(matched_idxs)):
        raise ValueError(
            f"one entry per image expected, got {len(gt_masks)} mask tensors, {len(proposals)} proposal "
            f"tensors and {len(matched_idxs)} index tensors"
        )
    if not proposals:
        raise ValueError("project_masks_on_boxes needs at least one image")
    used = [i for i, boxes in enumerate(proposals) if boxes.shape[0] > 0]
    if not used:
        return proposals[0].new_zeros((0, size, size))
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in used:
        groups.setdefault(tuple(gt_masks[i].shape[-2:]), []).append(i)
    if len(groups) == 1:
        return _project_group(
            [gt_masks[i] for i in used], [proposals[i] for i in used], [matched_idxs[i] for i in used], size
        )
    per_image: dict[int, Tensor] = {}
    for images in groups.values():
        targets = _project_group(
            [gt_masks[i] for i in images],
            [proposals[i] for i in images],
            [matched_idxs[i] for i in images],
            size,
        )
        per_image.update(zip(images, targets.split([proposals[i].shape[0] for i in images])))
    return torch.cat([per_image[i] for i in used])


def maskrcnn_loss(
    mask_logits: Tensor,
    proposals: Sequence[Tensor],
    gt_masks: Sequence[Tensor],
    gt_labels: Sequence[Tensor],
    mask_matched_idxs: Sequence[Tensor],
) -> Tensor:
    """torchvision's ``maskrcnn_loss`` with the targets of :func:`project_masks_on_boxes`.

    Args:
        mask_logits (Tensor[sum K_i, num_classes, S, S]): the mask head's logits of the positive proposals.
        proposals, gt_masks, mask_matched_idxs: as for :func:`project_masks_on_boxes`.
        gt_labels (List[Tensor[M_i]], int64): each image's ground-truth classes.

    Returns:
        :func:`~lit_amp_det.models.detection_core.mask_head_loss`: the mean binary cross-entropy of each
        proposal's own-class mask logits against its target; 0, connected to the logits (so the graph keeps
        every parameter), when the batch has no positive proposal.
    """
    labels = positive_labels(gt_labels, mask_matched_idxs)
    targets = project_masks_on_boxes(gt_masks, proposals, mask_matched_idxs, mask_logits.shape[-1])
    return mask_head_loss(mask_logits, labels, targets)


def positive_labels(gt_labels: Sequence[Tensor], mask_matched_idxs: Sequence[Tensor]) -> Tensor:
    """``Tensor[sum K_i]``: the class of every positive proposal's matched ground truth, in image order."""
    return torch.cat([labels[idxs] for labels, idxs in zip(gt_labels, mask_matched_idxs)])

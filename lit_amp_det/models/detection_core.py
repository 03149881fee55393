"""The rules both R-CNN pipelines share, as functions: the dynamic one and the fixed-shape one call these.

:mod:`lit_amp_det.models.ext_ops` (proposals and detections of data-dependent count, gathered by boolean
index) and :mod:`lit_amp_det.models.sync_free` (fixed slots with ``valid`` flags) compute one detector. What
makes it that detector lives here once: the labels a proposal gets from its match, which proposals and
detections are candidates for NMS, the box and mask losses and the mask paste. Each function takes an optional
``valid``/``sampled`` mask: ``None`` is the dynamic pipeline, where every row is real; a mask is the
fixed-shape pipeline, whose padding rows are computed and then left out of the sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.models.detection._utils import Matcher
from torchvision.models.detection.roi_heads import expand_boxes, expand_masks
from torchvision.ops import boxes as box_ops

__all__ = [
    "MIN_DETECTION_SIDE",
    "background_labels",
    "box_head_losses",
    "detection_candidates",
    "labels_from_matches",
    "mask_head_loss",
    "masked_sum",
    "paste_masks_binary",
    "paste_masks_padded",
    "proposal_candidates",
    "smooth_l1_per_row",
    "top_proposals_per_level",
]

#: torchvision's smallest detection side (``remove_small_boxes(boxes, min_size=1e-2)`` in ``RoIHeads``).
MIN_DETECTION_SIDE = 1e-2

#: torchvision's ``beta`` of the smooth L1 box losses (RPN and RoI heads).
_SMOOTH_L1_BETA = 1 / 9

#: Detections pasted at a time by :func:`paste_masks_padded`: a large photo's temporaries stay bounded.
_PASTE_CHUNK = 16


# ---------------------------------------------------------------------------------------------- labelling


def labels_from_matches(matches: Tensor, gt_labels: Tensor, matcher: Matcher) -> tuple[Tensor, Tensor]:
    """Each proposal's ground truth and class from a ``Matcher``'s result, as torchvision's RoI heads label.

    Args:
        matches (Tensor[N], int64): the matched ground-truth row of every proposal, or the matcher's
            ``BELOW_LOW_THRESHOLD`` / ``BETWEEN_THRESHOLDS``.
        gt_labels (Tensor[G], int64): the image's ground-truth classes (``G >= 1``).
        matcher: the matcher that produced ``matches`` (its sentinel values are read).

    Returns:
        ``(matched [N], labels [N])``, int64: the ground-truth index (0 for unmatched proposals) and the
        class: the matched class, 0 for background, -1 for ignored. No boolean index: no host sync.
    """
    matched = matches.clamp(min=0)
    labels = gt_labels[matched].to(torch.int64)
    labels = labels.masked_fill(matches == matcher.BELOW_LOW_THRESHOLD, 0)
    labels = labels.masked_fill(matches == matcher.BETWEEN_THRESHOLDS, -1)
    return matched, labels


def background_labels(count: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """:func:`labels_from_matches` for an image without ground truth: every proposal is background.

    Args:
        count: the number of proposals.
        device: where the result lives.

    Returns:
        ``(matched [count], labels [count])``, int64 zeros.
    """
    matched = torch.zeros(count, dtype=torch.int64, device=device)
    return matched, torch.zeros_like(matched)


# ------------------------------------------------------------------------------------ candidate filtering


def top_proposals_per_level(
    proposals: Tensor,
    objectness: Tensor,
    num_anchors_per_level: list[int],
    pre_nms_top_n: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The RPN's best ``pre_nms_top_n`` anchors of each FPN level, as torchvision's ``filter_proposals``.

    Args:
        proposals (Tensor[B, A, 4]): every anchor's decoded box.
        objectness (Tensor[B * A, 1] or Tensor[B, A]): every anchor's objectness logit (detached here:
            proposals never backpropagate into it).
        num_anchors_per_level: ``A`` split by level.
        pre_nms_top_n: anchors kept per level and image.

    Returns:
        ``(boxes [B, T, 4], scores [B, T], levels [T])``: the kept boxes, their sigmoid scores and the
        level (int64) of each of the ``T`` columns.
    """
    num_images = proposals.shape[0]
    objectness = objectness.detach().reshape(num_images, -1)
    indices, levels, offset = [], [], 0
    for level, scores in enumerate(objectness.split(num_anchors_per_level, dim=1)):
        top = scores.topk(min(pre_nms_top_n, scores.shape[1]), dim=1).indices
        indices.append(top + offset)
        levels.append(torch.full((top.shape[1],), level, dtype=torch.int64, device=objectness.device))
        offset += scores.shape[1]
    candidates = torch.cat(indices, dim=1)
    rows = torch.arange(num_images, device=proposals.device)[:, None]
    return proposals[rows, candidates], torch.sigmoid(objectness[rows, candidates]), torch.cat(levels)


def proposal_candidates(
    boxes: Tensor,
    scores: Tensor,
    image_shape: tuple[int, int],
    min_size: float,
    score_thresh: float,
) -> tuple[Tensor, Tensor]:
    """One image's proposals clipped to it, and which of them go to NMS (torchvision's
    ``remove_small_boxes`` and score filter, as a mask).

    Args:
        boxes (Tensor[T, 4]): ``x1, y1, x2, y2`` proposals.
        scores (Tensor[T]): their objectness probabilities.
        image_shape: the image's height and width.
        min_size: the smallest side a proposal keeps.
        score_thresh: the lowest score a proposal keeps.

    Returns:
        ``(boxes [T, 4], usable [T])``: the clipped boxes and a bool mask of the candidates.
    """
    boxes = box_ops.clip_boxes_to_image(boxes, image_shape)
    widths = boxes[:, 2] - boxes[:, 0]
    heights = boxes[:, 3] - boxes[:, 1]
    return boxes, (widths >= min_size) & (heights >= min_size) & (scores >= score_thresh)


def detection_candidates(
    boxes: Tensor,
    scores: Tensor,
    image_shape: tuple[int, int],
    score_thresh: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One image's ``(box, class)`` pairs and which of them go to NMS, as torchvision's
    ``postprocess_detections`` filters them (background dropped, score above the threshold, sides at least
    :data:`MIN_DETECTION_SIDE`).

    Args:
        boxes (Tensor[N, C, 4]): each proposal's decoded box per class (column 0 is background).
        scores (Tensor[N, C]): the class probabilities.
        image_shape: the image's height and width.
        score_thresh: scores at or below it are dropped.

    Returns:
        ``(boxes [N * (C - 1), 4], scores [N * (C - 1)], labels [N * (C - 1)], usable [N * (C - 1)])``: every
        pair, proposal-major, with its class (int64, from 1) and a bool mask of the candidates.
    """
    num_classes = scores.shape[-1]
    boxes = box_ops.clip_boxes_to_image(boxes, image_shape)[:, 1:].reshape(-1, 4)
    labels = torch.arange(1, num_classes, device=scores.device).repeat(scores.shape[0])
    scores = scores[:, 1:].reshape(-1)
    widths = boxes[:, 2] - boxes[:, 0]
    heights = boxes[:, 3] - boxes[:, 1]
    usable = (scores > score_thresh) & (widths >= MIN_DETECTION_SIDE) & (heights >= MIN_DETECTION_SIDE)
    return boxes, scores, labels, usable


# ------------------------------------------------------------------------------------------------ losses


def masked_sum(values: Tensor, mask: Tensor | None) -> Tensor:
    """Sum of ``values`` where ``mask`` holds (all of them for ``None``).

    Selected rather than multiplied by the mask, since ``inf * 0`` is NaN: a padding row's degenerate box
    codes to inf.

    Args:
        values (Tensor[N]): the terms.
        mask (Tensor[N], bool, optional): the terms that count.

    Returns:
        A 0-d tensor.
    """
    return values.sum() if mask is None else torch.where(mask, values, 0.0).sum()


def _sample_count(rows: int, sampled: Tensor | None) -> Tensor | int:
    """The divisor of a mean over drawn samples: ``rows`` (a Python number) or the drawn count, at least 1."""
    return max(rows, 1) if sampled is None else sampled.sum().clamp(min=1)


def smooth_l1_per_row(deltas: Tensor, targets: Tensor, regressed: Tensor | None) -> Tensor:
    """torchvision's box regression loss term of each row: smooth L1 (``beta = 1/9``) summed over the 4
    coordinates.

    Args:
        deltas (Tensor[N, 4]): predicted box codes.
        targets (Tensor[N, 4]): target box codes.
        regressed (Tensor[N], bool, optional): the rows that are regressed; the others' targets are replaced
            by 0, since a background or padding row's target may be inf, whose gradient would be NaN even
            where not summed.

    Returns:
        Tensor[N]: the loss of each row.
    """
    if regressed is not None:
        targets = torch.where(regressed[:, None], targets, 0.0)
    return F.smooth_l1_loss(deltas, targets, beta=_SMOOTH_L1_BETA, reduction="none").sum(1)


def box_head_losses(
    class_logits: Tensor,
    box_regression: Tensor,
    labels: Tensor,
    regression_targets: Tensor,
    sampled: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """torchvision's ``fastrcnn_loss``: cross-entropy over the drawn samples, smooth L1 of the positives'
    own-class box deltas, both divided by the number of samples.

    Args:
        class_logits (Tensor[N, C]): the box predictor's class logits.
        box_regression (Tensor[N, C * 4]): its per-class box codes.
        labels (Tensor[N], int64): each sample's class (0 background; negative only where not ``sampled``).
        regression_targets (Tensor[N, 4]): each sample's target box codes.
        sampled (Tensor[N], bool, optional): the rows that are drawn samples; ``None``: all of them.

    Returns:
        ``(loss_classifier, loss_box_reg)``, 0-d.
    """
    classes = labels.clamp(min=0)
    rows = torch.arange(classes.shape[0], device=classes.device)
    regressed = labels > 0 if sampled is None else sampled & (labels > 0)
    count = _sample_count(classes.shape[0], sampled)
    classifier = F.cross_entropy(class_logits, classes, reduction="none")
    deltas = box_regression.reshape(classes.shape[0], -1, 4)[rows, classes]
    box_loss = smooth_l1_per_row(deltas, regression_targets, regressed)
    return masked_sum(classifier, sampled) / count, masked_sum(box_loss, regressed) / count


def mask_head_loss(
    mask_logits: Tensor,
    classes: Tensor,
    mask_targets: Tensor,
    positive: Tensor | None = None,
) -> Tensor:
    """torchvision's ``maskrcnn_loss`` given the targets: the mean binary cross-entropy of each positive
    sample's own-class mask logits against its target.

    Args:
        mask_logits (Tensor[K, C, S, S]): the mask predictor's logits of the samples.
        classes (Tensor[K], int64): each sample's class.
        mask_targets (Tensor[K, S, S]): each sample's target mask in ``[0, 1]``.
        positive (Tensor[K], bool, optional): the samples that count; ``None``: all of them.

    Returns:
        A 0-d tensor; 0 (still connected to the logits, so every parameter gets a gradient) when no sample
        counts.
    """
    rows = torch.arange(classes.shape[0], device=classes.device)
    per_sample = F.binary_cross_entropy_with_logits(
        mask_logits[rows, classes],
        mask_targets,
        reduction="none",
    ).mean(dim=(1, 2))
    return masked_sum(per_sample, positive) / _sample_count(classes.shape[0], positive)


# -------------------------------------------------------------------------------------------- mask paste


def _expanded_masks_and_corners(masks: Tensor, boxes: Tensor, padding: int) -> tuple[Tensor, Tensor]:
    """torchvision's ``paste_masks_in_image`` set-up: the masks padded by ``padding`` pixels each side and
    their boxes grown by the same scale, as int64 pixel corners (``[D, M + 2p, M + 2p]``, ``[D, 4]``).
    """
    padded, scale = expand_masks(masks, padding=padding)
    return padded[:, 0], expand_boxes(boxes, scale).to(dtype=torch.int64)


def paste_masks_binary(
    masks: Tensor,
    boxes: Tensor,
    image_size: tuple[int, int],
    threshold: float,
    padding: int = 1,
) -> Tensor:
    """``paste_masks_in_image(masks, boxes, image_size, padding) > threshold`` without its float canvases,
    bit for bit: each mask is resized to its box as torchvision resizes it and compared there (one host read
    of the box corners; the dynamic pipeline's paste).

    Args:
        masks (Tensor[N, 1, M, M]): mask probabilities.
        boxes (Tensor[N, 4]): ``x1, y1, x2, y2`` in image pixels.
        image_size: the image's height and width.
        threshold: the probability a pixel must exceed.
        padding: torchvision's mask padding.

    Returns:
        Tensor[N, 1, H, W], bool: pixels outside a box compare torchvision's zero with the threshold.
    """
    height, width = int(image_size[0]), int(image_size[1])
    count = masks.shape[0]
    pasted = torch.full((count, 1, height, width), threshold < 0.0, dtype=torch.bool, device=masks.device)
    if count == 0:
        return pasted
    padded, corners = _expanded_masks_and_corners(masks, boxes, padding)
    for k, (x0, y0, x1, y1) in enumerate(corners.tolist()):  # one host copy, not 4 N item reads
        box_w, box_h = max(x1 - x0 + 1, 1), max(y1 - y0 + 1, 1)
        left, right = max(x0, 0), min(x1 + 1, width)
        top, bottom = max(y0, 0), min(y1 + 1, height)
        if right <= left or bottom <= top:  # the box lies outside the image
            continue
        resized = F.interpolate(
            padded[k, None, None],
            size=(box_h, box_w),
            mode="bilinear",
            align_corners=False,
        )[0, 0]
        region = resized[top - y0 : bottom - y0, left - x0 : right - x0]
        pasted[k, 0, top:bottom, left:right] = region > threshold
    return pasted


def _source_coordinates(
    start: Tensor,
    end: Tensor,
    length: int,
    size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Along one image axis of ``length`` pixels, for each box ``[start, end]``: the two mask cells
    ``F.interpolate(bilinear, align_corners=False)`` reads at each pixel (``[D, length]`` int64, from a mask
    of ``size`` cells), their weights, and whether the pixel lies in the box.
    """
    extent = (end - start + 1).clamp(min=1)  # torchvision's box side, at least one pixel
    offset = torch.arange(length, device=start.device)[None, :] - start[:, None]
    ratio = (size / extent.to(torch.float32))[:, None]
    source = (ratio * (offset.to(torch.float32) + 0.5) - 0.5).clamp(min=0)
    low = source.to(torch.int64).clamp(max=size - 1)
    high_weight = (source - low).clamp(0, 1)
    high = low + (low < size - 1).to(torch.int64)
    inside = (offset >= 0) & (offset < extent[:, None])
    return low, high, 1 - high_weight, high_weight, inside


def paste_masks_padded(
    masks: Tensor,
    boxes: Tensor,
    image_size: tuple[int, int],
    threshold: float,
    padding: int = 1,
) -> Tensor:
    """``paste_masks_in_image(masks, boxes, image_size, padding) > threshold`` for all masks at once, with no
    per-detection loop and no host read (the fixed-shape pipeline's paste).

    Each box's expanded mask is resized to the box as ``F.interpolate(bilinear, align_corners=False)``
    resizes it (its source coordinates and weights, separable: along x, then y), read at every image pixel
    the box covers; a value within rounding of the threshold may compare the other way (about one pixel in
    10^6). Costs ``D x H x W`` work instead of the boxes' areas.

    Args:
        masks (Tensor[D, 1, M, M]), boxes (Tensor[D, 4]), image_size, threshold, padding: as for
            :func:`paste_masks_binary`.

    Returns:
        Tensor[D, 1, H, W], bool.
    """
    height, width = int(image_size[0]), int(image_size[1])
    padded, corners = _expanded_masks_and_corners(masks, boxes, padding)
    size = padded.shape[-1]
    x_low, x_high, x_w0, x_w1, x_in = _source_coordinates(corners[:, 0], corners[:, 2], width, size)
    y_low, y_high, y_w0, y_w1, y_in = _source_coordinates(corners[:, 1], corners[:, 3], height, size)
    rows = padded.shape[1]
    pasted = []
    for start in range(0, max(masks.shape[0], 1), _PASTE_CHUNK):
        k = slice(start, start + _PASTE_CHUNK)
        along_x = (
            padded[k].gather(2, x_low[k, None, :].expand(-1, rows, -1)) * x_w0[k, None, :]
            + padded[k].gather(2, x_high[k, None, :].expand(-1, rows, -1)) * x_w1[k, None, :]
        )
        values = (
            along_x.gather(1, y_low[k, :, None].expand(-1, -1, width)) * y_w0[k, :, None]
            + along_x.gather(1, y_high[k, :, None].expand(-1, -1, width)) * y_w1[k, :, None]
        )
        # outside its box a mask reads 0 (combined with & and |, not a bool where: ONNX lacks it)
        inside = y_in[k, :, None] & x_in[k, None, :]
        pasted.append(inside & (values > threshold) if threshold >= 0 else ~inside | (values > threshold))
    return torch.cat(pasted)[:, None]

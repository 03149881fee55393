"""Mask R-CNN with shapes fixed by the configuration: a step in which the host never waits for the device.

On a GPU every ``nonzero``, boolean-mask index, ``.item()`` or output of data-dependent size makes the host
wait for the device to drain, breaks the graph for ``torch.compile`` and rules out CUDA-graph capture. This
computes the same detector with every shape known before the step runs, as NVIDIA's MLPerf Mask R-CNN does:

* batches are padded to a size bucket (the resized short x long side, in either orientation), so shapes
  repeat;
* the RPN keeps exactly ``post_nms_top_n`` proposal slots per image with a validity mask, from the fixed-size
  NMS op :func:`lit_amp_det.ops.batched_nms_padded` (small and low-scoring boxes marked invalid instead of
  gathered out);
* anchors and proposals are matched by torchvision's ``Matcher`` rules written with three-argument ``where``,
  and sampled by top-k over random keys drawn on the device: a uniformly random subset of the size
  torchvision's ``BalancedPositiveNegativeSampler`` draws, in ``batch_size_per_image`` slots with a validity
  weight;
* the losses are masked sums divided by the sample count (torchvision's means); the mask head trains on the
  ``positive_fraction * batch_size_per_image`` positive slots of each image, weighted by validity;
* inference keeps ``detections_per_img`` slots per image and pastes all their masks in one vectorised pass:
  :meth:`SyncFreeMaskRCNN.forward_padded` returns them with each image's count, ``forward`` reads the counts
  once per batch and returns torchvision's per-image lists.

The rules it shares with the dynamic heads (labels from matches, candidate filters, box and mask losses,
mask paste) are the functions of :mod:`lit_amp_det.models.detection_core`; here they get ``valid`` masks
instead of gathered rows. :func:`fixed_shape_detector` builds the detector from a torchvision one's modules
(the ``sync_free`` speedup and ``build_detector(fixed_shape=True)`` call it), and :func:`is_fixed_shape` is
how code recognises it.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models.detection import FasterRCNN, MaskRCNN
from torchvision.models.detection._utils import BoxCoder, Matcher, encode_boxes
from torchvision.models.detection.generalized_rcnn import GeneralizedRCNN
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.rpn import concat_box_prediction_layers
from torchvision.models.detection.transform import GeneralizedRCNNTransform, _resize_image_and_masks

from lit_amp_det.errors import ArgumentError
from lit_amp_det.models.detection_core import (
    background_labels,
    box_head_losses,
    detection_candidates,
    labels_from_matches,
    mask_head_loss,
    masked_sum,
    paste_masks_padded,
    smooth_l1_per_row,
)
from lit_amp_det.models.ext_ops import (
    ExtRegionProposalNetwork,
    ExtRoIHeads,
    _check_target_types,
)
from lit_amp_det.models.mask_paste import BinaryMaskTransform
from lit_amp_det.models.mask_targets import project_masks_on_boxes
from lit_amp_det.ops import batched_nms_padded, box_iou

__all__ = [
    "DeviceBoxCoder",
    "DeviceConstants",
    "checked_instance_count",
    "FixedShapeTransform",
    "SyncFreeFasterRCNN",
    "SyncFreeMaskRCNN",
    "SyncFreeRPN",
    "SyncFreeRoIHeads",
    "fixed_shape_detector",
    "is_fixed_shape",
    "match",
    "sample_slots",
    "scale_boxes",
]


def match(quality: Tensor, matcher: Matcher, valid: Tensor | None = None) -> Tensor:
    """torchvision's ``matcher(quality)`` without a boolean index: each column of the ``[G, N]`` IoU matrix
    gets its best row, ``-1`` below the low threshold, ``-2`` between them; with ``allow_low_quality_matches``
    the columns that are some row's best keep their best row. Rows not ``valid`` (bool ``[G]``, padding) match
    nothing.
    """
    if valid is not None:
        quality = torch.where(valid[:, None], quality, -1.0)  # below any threshold, below any real IoU
    values, best = quality.max(dim=0)
    matches = torch.where(values < matcher.low_threshold, matcher.BELOW_LOW_THRESHOLD, best)
    between = (values >= matcher.low_threshold) & (values < matcher.high_threshold)
    matches = torch.where(between, matcher.BETWEEN_THRESHOLDS, matches)
    if matcher.allow_low_quality_matches:
        is_best = quality == quality.max(dim=1, keepdim=True).values
        is_best = (is_best if valid is None else is_best & valid[:, None]).any(dim=0)
        matches = torch.where(is_best, best, matches)
    return matches


def sample_slots(labels: Tensor, batch_size: int, positive_fraction: float) -> tuple[Tensor, Tensor, Tensor]:
    """torchvision's ``BalancedPositiveNegativeSampler`` for one image, in ``S = min(batch_size, N)`` fixed
    slots.

    ``labels (Tensor[N])``: ``>= 1`` positive, ``0`` negative, ``-1`` ignored. As torchvision, it draws
    ``min(#positives, int(batch_size * positive_fraction))`` positives and ``min(#negatives, batch_size -
    that)`` negatives uniformly at random (the top-k of uniform keys drawn on the device is a uniform subset).
    Returns ``(index [S], valid [S], positive [S])``: the drawn positives fill the first slots, the negatives
    the next; slots past the draw are not ``valid`` (their index is arbitrary).
    """
    n = labels.shape[0]
    slots = min(batch_size, n)
    keys = torch.rand(n, device=labels.device)
    slot = torch.arange(slots, device=labels.device)
    max_positives = min(int(batch_size * positive_fraction), slots)
    negative_keys, negatives = torch.where(labels == 0, keys, -1.0).topk(slots)
    if max_positives == 0:
        num_positives = torch.zeros((), dtype=torch.int64, device=labels.device)
        index = negatives
    else:
        positive_keys, positives = torch.where(labels >= 1, keys, -1.0).topk(max_positives)
        num_positives = (positive_keys >= 0).sum()
        index = torch.where(
            slot < num_positives,
            positives[slot.clamp(max=max_positives - 1)],
            negatives[(slot - num_positives).clamp(min=0)],
        )
    num_negatives = torch.minimum((negative_keys >= 0).sum(), batch_size - num_positives)
    return index, slot < num_positives + num_negatives, slot < num_positives


def _float32_ratio(new: int, old: int) -> float:
    """``new / old`` rounded to float32, as torchvision divides two float32 tensors of the sizes; exact as a
    Python float, so that multiplying a float32 tensor by it gives torchvision's products without a tensor
    from the host.
    """
    return float(np.float32(new) / np.float32(old))


def scale_boxes(boxes: Tensor, old_size: tuple[int, int], new_size: tuple[int, int]) -> Tensor:
    """torchvision's ``resize_boxes`` with the ratios as Python numbers: the same values, and no tensor built
    from host numbers on the boxes' device (a host-to-device copy per call on a GPU, an error under CUDA-graph
    capture).

    Args:
        boxes (Tensor[N, 4]): ``x1, y1, x2, y2`` in an image of ``old_size`` (height, width).
        old_size: the image's height and width the boxes are in.
        new_size: the height and width to scale them to.

    Returns:
        Tensor[N, 4]: the boxes in an image of ``new_size``.
    """
    ratio_height = _float32_ratio(int(new_size[0]), int(old_size[0]))
    ratio_width = _float32_ratio(int(new_size[1]), int(old_size[1]))
    x1, y1, x2, y2 = boxes.unbind(1)
    return torch.stack((x1 * ratio_width, y1 * ratio_height, x2 * ratio_width, y2 * ratio_height), dim=1)


class DeviceConstants:
    """Small constant tensors made once per device and dtype, so that a step never copies them from the
    host.
    """

    def __init__(self, values: list[float] | tuple[float, ...]) -> None:
        self.values = [float(v) for v in values]
        self._made: dict[tuple[torch.device, torch.dtype], Tensor] = {}

    def on(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The values as a ``[len(values)]`` tensor on ``device`` in ``dtype`` (made on the first call
        only).
        """
        key = (device, dtype)
        if key not in self._made:
            with torch.inference_mode(False):  # usable in training after a first call under inference_mode
                self._made[key] = torch.tensor(self.values, dtype=dtype, device=device)
        return self._made[key]


class DeviceBoxCoder(BoxCoder):
    """torchvision's ``BoxCoder`` without tensors made from host numbers in a step: the encoding weights are
    made once per device and dtype, and the decoding halves the box sizes with a Python scalar (the same
    values).
    """

    def __init__(self, weights: tuple[float, float, float, float], bbox_xform_clip: float) -> None:
        super().__init__(weights, bbox_xform_clip)
        self._weights = DeviceConstants(weights)

    def encode_single(self, reference_boxes: Tensor, proposals: Tensor) -> Tensor:
        weights = self._weights.on(reference_boxes.device, reference_boxes.dtype)
        return encode_boxes(reference_boxes, proposals, weights)

    def decode_single(self, rel_codes: Tensor, boxes: Tensor) -> Tensor:
        boxes = boxes.to(rel_codes.dtype)
        widths = boxes[:, 2] - boxes[:, 0]
        heights = boxes[:, 3] - boxes[:, 1]
        centre_x = boxes[:, 0] + 0.5 * widths
        centre_y = boxes[:, 1] + 0.5 * heights
        weight_x, weight_y, weight_w, weight_h = self.weights
        dx = rel_codes[:, 0::4] / weight_x
        dy = rel_codes[:, 1::4] / weight_y
        dw = torch.clamp(rel_codes[:, 2::4] / weight_w, max=self.bbox_xform_clip)  # exp() stays finite
        dh = torch.clamp(rel_codes[:, 3::4] / weight_h, max=self.bbox_xform_clip)
        box_centre_x = dx * widths[:, None] + centre_x[:, None]
        box_centre_y = dy * heights[:, None] + centre_y[:, None]
        half_width = 0.5 * (torch.exp(dw) * widths[:, None])
        half_height = 0.5 * (torch.exp(dh) * heights[:, None])
        corners = (
            box_centre_x - half_width,
            box_centre_y - half_height,
            box_centre_x + half_width,
            box_centre_y + half_height,
        )
        return torch.stack(corners, dim=2).flatten(1)


def device_box_coder(coder: BoxCoder) -> DeviceBoxCoder:
    """A :class:`DeviceBoxCoder` with ``coder``'s weights and clip."""
    return DeviceBoxCoder(coder.weights, coder.bbox_xform_clip)


class FixedShapeTransform(BinaryMaskTransform):
    """torchvision's detection transform with fixed batch shapes and a loop-free boolean mask paste.

    Batches are padded to a bucket, ``(S, L)``, ``(L, S)`` or ``(L, L)`` with ``S`` and ``L`` the largest
    resized short (at inference: the inference size) and long sides rounded up to ``size_divisible`` (a batch
    that fits none, with resizing skipped, is padded as torchvision pads it). The training scale is drawn with
    Python's ``random`` (seeded by Lightning's ``seed_everything``), not read back from a tensor.
    """

    def __init__(self, transform: GeneralizedRCNNTransform, mask_threshold: float) -> None:
        super().__init__(transform, mask_threshold)
        self._mean = DeviceConstants(self.image_mean)
        self._std = DeviceConstants(self.image_std)

    def torch_choice(self, k: list[int]) -> int:
        return k[0] if len(k) == 1 else random.choice(k)

    def batch_images(self, images: list[Tensor], size_divisible: int = 32) -> Tensor:
        def rounded(side: float) -> int:
            return int(math.ceil(side / size_divisible) * size_divisible)

        short, long = (
            rounded(max(self.min_size) if self.training else self.min_size[-1]),
            rounded(self.max_size),
        )
        height, width = max(i.shape[-2] for i in images), max(i.shape[-1] for i in images)
        buckets = [
            (h, w) for h, w in ((short, long), (long, short), (long, long)) if height <= h and width <= w
        ]
        if not buckets:
            return super().batch_images(images, size_divisible)
        batch = images[0].new_zeros((len(images), images[0].shape[0], *buckets[0]))
        for padded, image in zip(batch, images):
            padded[:, : image.shape[-2], : image.shape[-1]].copy_(image)
        return batch

    def paste(self, masks: Tensor, boxes: Tensor, image_size: tuple[int, int]) -> Tensor:
        return paste_masks_padded(masks, boxes, image_size, self.mask_threshold)

    def normalize(self, image: Tensor) -> Tensor:
        """torchvision's normalisation with the mean and std made once per device and dtype, not per image."""
        if not image.is_floating_point():
            raise TypeError(f"images should be floating point in [0, 1], got {image.dtype}")
        mean = self._mean.on(image.device, image.dtype)
        std = self._std.on(image.device, image.dtype)
        return (image - mean[:, None, None]) / std[:, None, None]

    def resize(
        self, image: Tensor, target: dict[str, Tensor] | None = None
    ) -> tuple[Tensor, dict[str, Tensor] | None]:
        """torchvision's resize (the same size choice and interpolation), with the boxes rescaled by
        :func:`scale_boxes`.
        """
        if self.training and self._skip_resize:
            return image, target
        size = self.torch_choice(self.min_size) if self.training else self.min_size[-1]
        old_size = (image.shape[-2], image.shape[-1])
        image, target = _resize_image_and_masks(image, size, self.max_size, target, self.fixed_size)
        if target is not None:
            target["boxes"] = scale_boxes(target["boxes"], old_size, (image.shape[-2], image.shape[-1]))
        return image, target

    def rescale_boxes(self, boxes: Tensor, size: tuple[int, int], original_size: tuple[int, int]) -> Tensor:
        """The detections' boxes back in the original image, by :func:`scale_boxes` (no tensor from the
        host).
        """
        return scale_boxes(boxes, size, original_size)


class SyncFreeRPN(ExtRegionProposalNetwork):
    """The RPN with ``post_nms_top_n`` proposal slots per image (``(boxes [B, P, 4], valid [B, P])``) and a
    training loss over anchors drawn by :func:`sample_slots`.

    Takes ``RegionProposalNetwork``'s arguments (:meth:`from_rpn` builds one from a built RPN); its box coder
    is a :class:`DeviceBoxCoder`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.box_coder = device_box_coder(self.box_coder)

    def forward(
        self, images: ImageList, features: dict[str, Tensor], targets: list[dict[str, Tensor]] | None = None
    ) -> tuple[tuple[Tensor, Tensor], dict[str, Tensor]]:
        maps = list(features.values())
        objectness, pred_bbox_deltas = self.head(maps)
        anchors = self.anchor_generator(images, maps)
        num_anchors_per_level = [o[0].numel() for o in objectness]
        objectness, pred_bbox_deltas = concat_box_prediction_layers(objectness, pred_bbox_deltas)
        proposals = self.box_coder.decode(pred_bbox_deltas.detach(), anchors).view(len(anchors), -1, 4)
        boxes = self.filter_proposals(proposals, objectness, images.image_sizes, num_anchors_per_level)
        if not self.training:
            return boxes, {}
        if targets is None:
            raise ValueError("targets should not be None")
        labels, regression_targets = self.anchor_targets(anchors, targets)
        loss_objectness, loss_rpn_box_reg = self.compute_loss(
            objectness, pred_bbox_deltas, labels, regression_targets
        )
        return boxes, {"loss_objectness": loss_objectness, "loss_rpn_box_reg": loss_rpn_box_reg}

    def nms_per_image(
        self,
        candidates: list[tuple[Tensor, Tensor]],
        scores: Tensor,
        levels: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """:class:`ExtRegionProposalNetwork`'s selection (same arguments) as fixed slots: each image's kept
        proposals in score order, then padding marked not valid.

        Returns:
            ``(boxes [B, P, 4], valid [B, P])`` with ``P = post_nms_top_n``: what ``filter_proposals``
            returns.
        """
        kept, valid = [], []
        for (image_boxes, usable), image_scores in zip(candidates, scores):
            keep, count = batched_nms_padded(
                image_boxes,
                image_scores,
                levels,
                self.nms_thresh,
                self.post_nms_top_n(),
                valid=usable,
                max_class_size=self.pre_nms_top_n(),
            )
            kept.append(image_boxes[keep.clamp(min=0)])
            valid.append(torch.arange(keep.shape[0], device=keep.device) < count)
        return torch.stack(kept), torch.stack(valid)

    def anchor_targets(
        self, anchors: list[Tensor], targets: list[dict[str, Tensor]]
    ) -> tuple[Tensor, Tensor]:
        """``[B * A]`` labels of the drawn anchors (1 object, 0 background, -1 not drawn) and ``[B * A, 4]``
        regression targets: torchvision's ``assign_targets_to_anchors`` and ``fg_bg_sampler``.
        """
        labels, matched_boxes = [], []
        sampler = self.fg_bg_sampler
        for image_anchors, target in zip(anchors, targets):
            gt_boxes = target["boxes"]
            if gt_boxes.shape[0] == 0:  # background only
                image_labels = torch.zeros(image_anchors.shape[0], device=image_anchors.device)
                matched_boxes.append(torch.zeros_like(image_anchors))
            else:
                quality = self.box_similarity(gt_boxes, image_anchors)
                matches = match(quality, self.proposal_matcher, target.get("valid"))
                matched_boxes.append(gt_boxes[matches.clamp(min=0)])
                image_labels = (matches >= 0).to(torch.float32)
                image_labels = image_labels.masked_fill(
                    matches == self.proposal_matcher.BETWEEN_THRESHOLDS, -1.0
                )
            index, valid, positive = sample_slots(
                image_labels, sampler.batch_size_per_image, sampler.positive_fraction
            )
            # drawn indices are distinct, so adding each valid slot's value once is exact (and needs no
            # scatter order)
            drawn = torch.where(valid, positive.to(torch.float32) + 1, 0.0)
            labels.append(
                torch.full((image_labels.shape[0],), -1.0, device=index.device).index_add_(0, index, drawn)
            )
        regression_targets = self.box_coder.encode(matched_boxes, anchors)
        return torch.cat(labels), torch.cat(regression_targets)

    def compute_loss(
        self, objectness: Tensor, pred_bbox_deltas: Tensor, labels: Tensor, regression_targets: Tensor
    ) -> tuple[Tensor, Tensor]:
        """torchvision's RPN losses over the drawn anchors of ``labels`` (see :meth:`anchor_targets`)."""
        count = (labels >= 0).sum().clamp(min=1)
        box_loss = smooth_l1_per_row(pred_bbox_deltas, regression_targets, labels > 0)
        objectness_loss = F.binary_cross_entropy_with_logits(
            objectness.flatten(), labels.clamp(min=0), reduction="none"
        )
        return masked_sum(objectness_loss, labels >= 0) / count, masked_sum(box_loss, labels > 0) / count


class SyncFreeRoIHeads(ExtRoIHeads):
    """The RoI heads on the RPN's proposal slots: ``batch_size_per_image`` drawn slots per training image, and
    ``detections_per_img`` detection slots per image with their count at inference.

    Takes ``RoIHeads``' arguments (:meth:`from_roi_heads` builds them from built heads); the box coder is a
    :class:`DeviceBoxCoder`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.box_coder = device_box_coder(self.box_coder)

    def forward(
        self,
        features: dict[str, Tensor],
        proposals: tuple[Tensor, Tensor],
        image_shapes: list[tuple[int, int]],
        targets: list[dict[str, Tensor]] | None = None,
    ) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
        boxes, valid = proposals
        if not self.training:
            return self._detect(features, boxes, valid, image_shapes), {}
        if targets is None:
            raise ValueError("targets should not be None")
        _check_target_types(targets)
        return [], self._losses(features, boxes, valid, image_shapes, targets)

    def _draw(
        self,
        boxes: Tensor,
        valid: Tensor,
        gt_boxes: Tensor,
        gt_labels: Tensor,
        gt_valid: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        """One image's drawn slots: ``(boxes, matched gt index, label, valid, positive)``, torchvision's
        ``select_training_samples`` (ground truth added to the proposals, matched, drawn).
        """
        boxes = torch.cat([boxes, gt_boxes.to(boxes.dtype)])
        usable = torch.cat([valid, valid.new_ones(gt_boxes.shape[0]) if gt_valid is None else gt_valid])
        if gt_boxes.shape[0] == 0:
            matched, labels = background_labels(boxes.shape[0], boxes.device)
        else:
            matches = match(box_iou(gt_boxes, boxes), self.proposal_matcher, gt_valid)
            matched, labels = labels_from_matches(matches, gt_labels, self.proposal_matcher)
        labels = labels.masked_fill(~usable, -1)  # proposal padding is never drawn
        index, drawn, positive = sample_slots(
            labels, self.fg_bg_sampler.batch_size_per_image, self.fg_bg_sampler.positive_fraction
        )
        return boxes[index], matched[index], labels[index], drawn, positive

    def _losses(
        self,
        features: dict[str, Tensor],
        proposals: Tensor,
        valid: Tensor,
        image_shapes: list[tuple[int, int]],
        targets: list[dict[str, Tensor]],
    ) -> dict[str, Tensor]:
        gt_boxes = [t["boxes"] for t in targets]
        draws = [
            self._draw(p, v, g, t["labels"], t.get("valid"))
            for p, v, g, t in zip(proposals, valid, gt_boxes, targets)
        ]
        boxes, matched, labels, drawn, positive = (torch.stack(parts) for parts in zip(*draws))
        matched_boxes = [
            g[m] if g.shape[0] else torch.zeros_like(b) for g, m, b in zip(gt_boxes, matched, boxes)
        ]
        regression_targets = torch.cat(self.box_coder.encode(matched_boxes, list(boxes)))
        class_logits, box_regression = self.box_predictor(
            self.box_head(self.box_roi_pool(features, list(boxes), image_shapes))
        )
        loss_classifier, loss_box_reg = box_head_losses(
            class_logits,
            box_regression,
            labels.flatten(),
            regression_targets,
            sampled=drawn.flatten(),
        )
        losses = {"loss_classifier": loss_classifier, "loss_box_reg": loss_box_reg}
        if self.has_mask():
            classes = labels.clamp(min=0)
            losses["loss_mask"] = self._mask_loss(
                features, boxes, matched, classes, positive, image_shapes, targets
            )
        return losses

    def _mask_loss(
        self,
        features: dict[str, Tensor],
        boxes: Tensor,
        matched: Tensor,
        classes: Tensor,
        positive: Tensor,
        image_shapes: list[tuple[int, int]],
        targets: list[dict[str, Tensor]],
    ) -> Tensor:
        """torchvision's mask loss over the positive slots (the first ``positive_fraction *
        batch_size_per_image`` of each image, weighted by :func:`sample_slots`' ``positive``).
        """
        slots = min(
            int(self.fg_bg_sampler.batch_size_per_image * self.fg_bg_sampler.positive_fraction),
            boxes.shape[1],
        )
        boxes, matched, classes, positive = (t[:, :slots] for t in (boxes, matched, classes, positive))
        logits = self.mask_predictor(self.mask_head(self.mask_roi_pool(features, list(boxes), image_shapes)))
        # an image without ground truth crops a blank mask (its slots are never positive)
        gt_masks = [
            t["masks"] if t["masks"].shape[0] else t["masks"].new_zeros((1, *t["masks"].shape[-2:]))
            for t in targets
        ]
        mask_targets = project_masks_on_boxes(gt_masks, list(boxes), list(matched), logits.shape[-1])
        return mask_head_loss(logits, classes.flatten(), mask_targets, positive.flatten())

    def _detect(
        self,
        features: dict[str, Tensor],
        proposals: Tensor,
        valid: Tensor,
        image_shapes: list[tuple[int, int]],
    ) -> list[dict[str, Tensor]]:
        class_logits, box_regression = self.box_predictor(
            self.box_head(self.box_roi_pool(features, list(proposals), image_shapes))
        )
        boxes, scores, labels, counts = self.postprocess_detections(
            class_logits, box_regression, (proposals, valid), image_shapes
        )
        result = [
            {"boxes": b, "scores": s, "labels": lab, "count": n}
            for b, s, lab, n in zip(boxes, scores, labels, counts)
        ]
        if self.has_mask():
            logits = self.mask_predictor(
                self.mask_head(self.mask_roi_pool(features, list(boxes), image_shapes))
            )
            rows = torch.arange(logits.shape[0], device=logits.device)
            probabilities = logits[rows, labels.flatten()].sigmoid()[:, None].unflatten(0, labels.shape)
            for image_result, masks in zip(result, probabilities):
                image_result["masks"] = masks
        return result

    def postprocess_detections(
        self,
        class_logits: Tensor,
        box_regression: Tensor,
        proposals: tuple[Tensor, Tensor],
        image_shapes: list[tuple[int, int]],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:class:`ExtRoIHeads`' detections as ``[B, D]`` slots (boxes, scores, labels) and ``[B]`` counts,
        with its score and size filters and the proposal padding as NMS's ``valid`` mask.
        """
        proposal_boxes, proposal_valid = proposals
        num_images, num_proposals = proposal_valid.shape
        all_boxes = self.box_coder.decode(box_regression, list(proposal_boxes))
        all_boxes = all_boxes.reshape(num_images, num_proposals, -1, 4)
        all_scores = F.softmax(class_logits, -1).reshape(num_images, num_proposals, -1)
        num_classes = all_scores.shape[-1]
        kept = []
        for boxes, scores, proposal_ok, shape in zip(all_boxes, all_scores, proposal_valid, image_shapes):
            boxes, scores, labels, usable = detection_candidates(boxes, scores, shape, self.score_thresh)
            usable &= proposal_ok[:, None].expand(-1, num_classes - 1).reshape(-1)
            keep, count = batched_nms_padded(
                boxes,
                scores,
                labels,
                self.nms_thresh,
                self.detections_per_img,
                valid=usable,
                max_class_size=num_proposals,
            )
            keep = keep.clamp(min=0)
            kept.append((boxes[keep], scores[keep], labels[keep], count))
        return tuple(torch.stack(parts) for parts in zip(*kept))  # type: ignore[return-value]


class _SyncFreeForward(GeneralizedRCNN):
    """A :mod:`sync_free <lit_amp_det.models.sync_free>` detector: built from its parts, with the fixed-shape
    ``forward`` (mixed into torchvision's class, so that ``isinstance(model, MaskRCNN)`` still holds).

    Args:
        backbone: the feature extractor (an ``out_channels`` attribute, as torchvision's).
        rpn: the fixed-shape RPN.
        roi_heads: the fixed-shape RoI heads.
        transform: the fixed-shape transform.
        instances_per_image: the number of ground-truth instances every training target is padded to (a
            ``valid`` flag each), so that a step's shapes never change; the data module pads to it
            (:func:`lit_amp_det.data.coco.pad_instances`). None: each image's own count.

    Raises:
        ArgumentError: ``instances_per_image`` is not a positive whole number.
    """

    def __init__(
        self,
        backbone: nn.Module,
        rpn: SyncFreeRPN,
        roi_heads: SyncFreeRoIHeads,
        transform: FixedShapeTransform,
        instances_per_image: int | None = None,
    ) -> None:
        # torchvision's FasterRCNN/MaskRCNN constructors only build these parts from settings; here they
        # come built, so the class skips to the constructor that takes them
        GeneralizedRCNN.__init__(self, backbone, rpn, roi_heads, transform)
        self.instances_per_image = checked_instance_count(instances_per_image)

    def forward_padded(
        self, images: list[Tensor], targets: list[dict[str, Tensor]] | None = None
    ) -> dict[str, Tensor] | list[dict[str, Tensor]]:
        """Training: torchvision's loss dict. Inference: per image ``boxes [D, 4]``, ``scores [D]``, ``labels
        [D]``, ``masks [D, 1, H, W]`` (booleans) and ``count`` (0-d): the first ``count`` slots are the
        detections.
        """
        if self.training and targets is None:
            raise ValueError("targets should not be None in training mode")
        original_image_sizes = [(int(image.shape[-2]), int(image.shape[-1])) for image in images]
        batch, targets = self.transform(images, targets)
        for index, target in enumerate(
            targets or []
        ):  # torchvision's check (padding aside), read back if it fails
            positive = (target["boxes"][:, 2:] > target["boxes"][:, :2]).all(1)
            if "valid" in target:
                positive = positive | ~target["valid"]
            torch._assert_async(
                positive.all(),
                f"All bounding boxes should have positive height and width: target "
                f"{index} has one that does not",
            )
        features = self.backbone(batch.tensors)
        if isinstance(features, Tensor):
            features = OrderedDict([("0", features)])
        proposals, proposal_losses = self.rpn(batch, features, targets)
        detections, detector_losses = self.roi_heads(features, proposals, batch.image_sizes, targets)
        if self.training:
            return {**detector_losses, **proposal_losses}
        return self.transform.postprocess(detections, batch.image_sizes, original_image_sizes)

    def forward(
        self, images: list[Tensor], targets: list[dict[str, Tensor]] | None = None
    ) -> dict[str, Tensor] | list[dict[str, Tensor]]:
        """torchvision's outputs: the loss dict in training, per-image detection lists otherwise."""
        out = self.forward_padded(images, targets)
        if self.training:
            return out
        counts = (
            torch.stack([d["count"] for d in out]).tolist() if out else []
        )  # the one read of the device per batch
        return [{k: v[:n] for k, v in d.items() if k != "count"} for d, n in zip(out, counts)]


def checked_instance_count(instances_per_image: int | None) -> int | None:
    """The ``instances_per_image`` setting checked.

    Args:
        instances_per_image: the padded instance count of a training target, or None.

    Returns:
        It as an ``int``, or None.

    Raises:
        ArgumentError: it is not a whole number of at least 1.
    """
    if instances_per_image is None:
        return None
    whole = not isinstance(instances_per_image, bool) and int(instances_per_image) == instances_per_image
    if not whole or instances_per_image < 1:
        raise ArgumentError(
            "instances_per_image",
            instances_per_image,
            "must be a whole number of at least 1, or null to keep each image's count",
        )
    return int(instances_per_image)


class SyncFreeFasterRCNN(_SyncFreeForward, FasterRCNN):
    """torchvision's ``FasterRCNN`` computed with fixed shapes (:func:`fixed_shape_detector`)."""


class SyncFreeMaskRCNN(_SyncFreeForward, MaskRCNN):
    """torchvision's ``MaskRCNN`` computed with fixed shapes (:func:`fixed_shape_detector`)."""


_FIXED_SHAPE_CLASSES: dict[type[nn.Module], type[_SyncFreeForward]] = {
    FasterRCNN: SyncFreeFasterRCNN,
    MaskRCNN: SyncFreeMaskRCNN,
}


def is_fixed_shape(model: object) -> bool:
    """Whether ``model`` is a fixed-shape detector (:func:`fixed_shape_detector`): its training step's shapes
    are fixed by the configuration and its inference returns detection slots (``forward_padded``).

    The one test for it: code that treats the fixed-shape detector differently asks this, not ``hasattr``.

    Args:
        model: any object; a detector, or None.

    Returns:
        True for a :class:`SyncFreeFasterRCNN` or :class:`SyncFreeMaskRCNN`.
    """
    return isinstance(model, _SyncFreeForward)


def fixed_shape_detector(model: nn.Module, instances_per_image: int | None = None) -> nn.Module:
    """The fixed-shape detector with ``model``'s backbone, heads' submodules and settings.

    The RPN, RoI heads and transform are built anew (:meth:`SyncFreeRPN.from_rpn`,
    :meth:`SyncFreeRoIHeads.from_roi_heads`, :class:`FixedShapeTransform`) around ``model``'s modules, which
    move over, not copied: the result shares ``model``'s parameters, and its ``state_dict`` has the same keys.
    The fixed-shape heads are built on lit_amp_det's ops (they extend :mod:`~lit_amp_det.models.ext_ops`'
    heads), so torchvision's poolers become lit_amp_det's.

    Args:
        model: torchvision's ``FasterRCNN`` or ``MaskRCNN`` (its heads torchvision's or lit_amp_det's), or a
            fixed-shape detector.
        instances_per_image: the training targets' padded instance count (see :class:`SyncFreeMaskRCNN`);
            it is set on a ``model`` that already is fixed-shape when given.

    Returns:
        A :class:`SyncFreeFasterRCNN` or :class:`SyncFreeMaskRCNN` in ``model``'s training mode; ``model``
        itself if it already is one.

    Raises:
        TypeError: ``model`` is another module, has keypoint heads, or heads of a subclass lit_amp_det
            does not know.
        ArgumentError: ``instances_per_image`` is not a positive whole number.
    """
    if is_fixed_shape(model):
        if instances_per_image is not None:
            model.instances_per_image = checked_instance_count(instances_per_image)
        return model
    detector_class = _FIXED_SHAPE_CLASSES.get(type(model))
    if detector_class is None or model.roi_heads.has_keypoint():
        raise TypeError(
            f"speedups.sync_free converts torchvision's FasterRCNN and MaskRCNN, got "
            f"{type(model).__qualname__}; turn it off with speedups.sync_free=null"
        )
    detector = detector_class(
        model.backbone,
        SyncFreeRPN.from_rpn(model.rpn),
        SyncFreeRoIHeads.from_roi_heads(model.roi_heads),
        FixedShapeTransform(model.transform, getattr(model.transform, "mask_threshold", 0.5)),
        instances_per_image,
    )
    return detector.train(model.training)

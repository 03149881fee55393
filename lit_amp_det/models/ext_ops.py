"""Runs torchvision's R-CNN heads on lit_amp_det's own ops.

:class:`ExtRegionProposalNetwork` and :class:`ExtRoIHeads` are torchvision's RPN and RoI heads with a few
methods re-implemented around :mod:`lit_amp_det.ops`: NMS that stops at the number of boxes kept afterwards
(``post_nms_top_n`` proposals, ``detections_per_img`` detections), the fused fp32 IoU for the matchers, one
RoIAlign call for a training batch's mask targets (:mod:`lit_amp_det.models.mask_targets`), fewer host syncs
(none: :mod:`.sync_free`). They add no parameters, buffers or attributes, so :func:`use_extension_ops`
switches a built torchvision model by changing the class of its ``rpn`` and ``roi_heads`` (torchvision offers
no hook to pass others); ``state_dict`` keys, checkpoints and the fp32 regions are unchanged. The poolers
become :class:`lit_amp_det.ops.MultiScaleRoIAlign` (level scales carried over); the losses are the same
numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.models.detection.generalized_rcnn import GeneralizedRCNN
from torchvision.models.detection.roi_heads import RoIHeads, fastrcnn_loss
from torchvision.models.detection.rpn import RegionProposalNetwork
from torchvision.ops import MultiScaleRoIAlign as TorchvisionMultiScaleRoIAlign
from torchvision.ops import boxes as box_ops

from lit_amp_det.models.mask_targets import maskrcnn_loss
from lit_amp_det.ops import MultiScaleRoIAlign, batched_nms, box_iou

__all__ = ["ExtRegionProposalNetwork", "ExtRoIHeads", "use_extension_ops"]


class ExtRegionProposalNetwork(RegionProposalNetwork):
    """torchvision's RPN; proposal filtering stops NMS at ``post_nms_top_n`` and matching uses the fused IoU."""

    def filter_proposals(
        self,
        proposals: Tensor,
        objectness: Tensor,
        image_shapes: list[tuple[int, int]],
        num_anchors_per_level: list[int],
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Per image: best ``pre_nms_top_n`` anchors of each level -> clip, drop small and low-scoring boxes
        -> NMS per level, stopped at ``post_nms_top_n`` kept proposals.
        """
        num_images = proposals.shape[0]
        objectness = objectness.detach().reshape(num_images, -1)  # proposals never backprop into objectness
        candidates, levels = self._top_anchors_per_level(objectness, num_anchors_per_level)
        rows = torch.arange(num_images, device=proposals.device)[:, None]
        scores = torch.sigmoid(objectness[rows, candidates])
        boxes = proposals[rows, candidates]
        kept = [self._select(b, s, levels, shape) for b, s, shape in zip(boxes, scores, image_shapes)]
        return [b for b, _ in kept], [s for _, s in kept]

    def _top_anchors_per_level(
        self, objectness: Tensor, num_anchors_per_level: list[int]
    ) -> tuple[Tensor, Tensor]:
        """Indices ``[B, T]`` of each level's best anchors (into all anchors) and the level ``[T]`` of each."""
        indices, levels, offset = [], [], 0
        for level, scores in enumerate(objectness.split(num_anchors_per_level, dim=1)):
            top = scores.topk(min(self.pre_nms_top_n(), scores.shape[1]), dim=1).indices
            indices.append(top + offset)
            levels.append(torch.full((top.shape[1],), level, dtype=torch.int64, device=objectness.device))
            offset += scores.shape[1]
        return torch.cat(indices, dim=1), torch.cat(levels)

    def _select(
        self, boxes: Tensor, scores: Tensor, levels: Tensor, image_shape: tuple[int, int]
    ) -> tuple[Tensor, Tensor]:
        boxes = box_ops.clip_boxes_to_image(boxes, image_shape)
        widths, heights = (
            boxes[:, 2] - boxes[:, 0],
            boxes[:, 3] - boxes[:, 1],
        )  # remove_small_boxes + scores, 1 sync
        keep = torch.where(
            (widths >= self.min_size) & (heights >= self.min_size) & (scores >= self.score_thresh)
        )[0]
        boxes, scores, levels = boxes[keep], scores[keep], levels[keep]
        keep = batched_nms(boxes, scores, levels, self.nms_thresh, max_output=self.post_nms_top_n())
        return boxes[keep], scores[keep]


def _check_target_types(targets: list[dict[str, Tensor]]) -> None:
    """torchvision's ``RoIHeads.forward`` checks of the targets' dtypes, with its messages."""
    for t in targets:
        if t["boxes"].dtype not in (torch.float, torch.double, torch.half):
            raise TypeError(f"target boxes must of float type, instead got {t['boxes'].dtype}")
        if t["labels"].dtype != torch.int64:
            raise TypeError(f"target labels must of int64 type, instead got {t['labels'].dtype}")


class ExtRoIHeads(RoIHeads):
    """torchvision's RoI heads; proposal matching uses the fused IoU, detection NMS stops at
    ``detections_per_img``, and a training step crops the mask targets of all images with one RoIAlign call.

    ``batched_mask_targets`` (class attribute; set it on an instance to A/B) switches the last back to
    torchvision's per-image ``project_masks_on_boxes``.
    """

    batched_mask_targets: bool = True

    def forward(
        self,
        features: dict[str, Tensor],
        proposals: list[Tensor],
        image_shapes: list[tuple[int, int]],
        targets: list[dict[str, Tensor]] | None = None,
    ) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
        """torchvision's ``RoIHeads.forward``; training a mask head (without keypoints) takes
        :meth:`_train_masks`.
        """
        if self.training and self.batched_mask_targets and self.has_mask() and not self.has_keypoint():
            return [], self._train_masks(features, proposals, image_shapes, targets)
        return super().forward(features, proposals, image_shapes, targets)

    def _train_masks(
        self,
        features: dict[str, Tensor],
        proposals: list[Tensor],
        image_shapes: list[tuple[int, int]],
        targets: list[dict[str, Tensor]] | None,
    ) -> dict[str, Tensor]:
        """The training branch of torchvision's forward for box and mask heads, step for step, with the mask
        loss of :func:`lit_amp_det.models.mask_targets.maskrcnn_loss` (one RoIAlign call for the batch's
        targets).
        """
        if targets is None:
            raise ValueError(
                "targets should not be None"
            )  # torchvision's select_training_samples says the same
        _check_target_types(targets)
        proposals, matched_idxs, labels, regression_targets = self.select_training_samples(proposals, targets)
        box_features = self.box_head(self.box_roi_pool(features, proposals, image_shapes))
        class_logits, box_regression = self.box_predictor(box_features)
        loss_classifier, loss_box_reg = fastrcnn_loss(
            class_logits, box_regression, labels, regression_targets
        )
        positives = [
            torch.where(image_labels > 0)[0] for image_labels in labels
        ]  # masks train on positives only
        mask_proposals = [boxes[pos] for boxes, pos in zip(proposals, positives)]
        pos_matched_idxs = [idxs[pos] for idxs, pos in zip(matched_idxs, positives)]
        mask_features = self.mask_head(self.mask_roi_pool(features, mask_proposals, image_shapes))
        gt_masks, gt_labels = [t["masks"] for t in targets], [t["labels"] for t in targets]
        loss_mask = maskrcnn_loss(
            self.mask_predictor(mask_features), mask_proposals, gt_masks, gt_labels, pos_matched_idxs
        )
        return {"loss_classifier": loss_classifier, "loss_box_reg": loss_box_reg, "loss_mask": loss_mask}

    def assign_targets_to_proposals(
        self, proposals: list[Tensor], gt_boxes: list[Tensor], gt_labels: list[Tensor]
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Matched ground-truth index and class (0 background, -1 ignored) of every proposal."""
        matched_idxs, labels = [], []
        for proposals_in_image, gt_boxes_in_image, gt_labels_in_image in zip(proposals, gt_boxes, gt_labels):
            if gt_boxes_in_image.numel() == 0:  # background-only image
                matched = proposals_in_image.new_zeros(proposals_in_image.shape[0], dtype=torch.int64)
                matched_idxs.append(matched)
                labels.append(torch.zeros_like(matched))
                continue
            matches = self.proposal_matcher(box_iou(gt_boxes_in_image, proposals_in_image))
            matched = matches.clamp(min=0)
            image_labels = gt_labels_in_image[matched].to(
                torch.int64
            )  # masked_fill: no mask index, no host sync
            image_labels = image_labels.masked_fill(matches == self.proposal_matcher.BELOW_LOW_THRESHOLD, 0)
            image_labels = image_labels.masked_fill(
                matches == self.proposal_matcher.BETWEEN_THRESHOLDS, -1
            )  # ignored
            matched_idxs.append(matched)
            labels.append(image_labels)
        return matched_idxs, labels

    def postprocess_detections(
        self,
        class_logits: Tensor,
        box_regression: Tensor,
        proposals: list[Tensor],
        image_shapes: list[tuple[int, int]],
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """Decoded, clipped, per-class NMS'd detections: at most ``detections_per_img`` per image."""
        per_image = [p.shape[0] for p in proposals]
        all_boxes = self.box_coder.decode(box_regression, proposals).split(per_image)
        all_scores = F.softmax(class_logits, -1).split(per_image)
        results = [
            self._detections_in_image(b, s, shape) for b, s, shape in zip(all_boxes, all_scores, image_shapes)
        ]
        return [r[0] for r in results], [r[1] for r in results], [r[2] for r in results]

    def _detections_in_image(
        self, boxes: Tensor, scores: Tensor, image_shape: tuple[int, int]
    ) -> tuple[Tensor, Tensor, Tensor]:
        num_classes = scores.shape[-1]
        boxes = box_ops.clip_boxes_to_image(boxes, image_shape)[:, 1:].reshape(
            -1, 4
        )  # every (box, class) pair
        labels = torch.arange(1, num_classes, device=scores.device).repeat(scores.shape[0])
        scores = scores[:, 1:].reshape(-1)  # column 0 is background
        widths, heights = (
            boxes[:, 2] - boxes[:, 0],
            boxes[:, 3] - boxes[:, 1],
        )  # torchvision's filters, one nonzero
        keep = torch.where((scores > self.score_thresh) & (widths >= 1e-2) & (heights >= 1e-2))[0]
        boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
        keep = batched_nms(boxes, scores, labels, self.nms_thresh, max_output=self.detections_per_img)
        return boxes[keep], scores[keep], labels[keep]


def _lit_pooler(pooler: TorchvisionMultiScaleRoIAlign) -> MultiScaleRoIAlign:
    lit = MultiScaleRoIAlign(
        pooler.featmap_names,
        pooler.output_size,
        pooler.sampling_ratio,
        canonical_scale=pooler.canonical_scale,
        canonical_level=pooler.canonical_level,
    )
    if pooler.scales is not None:  # a model that already ran keeps the scales torchvision inferred
        lit.scales = list(pooler.scales)
    return lit


def use_extension_ops(model: GeneralizedRCNN) -> GeneralizedRCNN:
    """Switches a torchvision Faster/Mask R-CNN over to lit_amp_det's ops, in place; returns it.

    Only exact torchvision classes are converted: a subclass of torchvision's RPN or RoI heads has its own
    behaviour that a class change would silently drop, so it raises instead.
    """
    for name, expected, replacement in (
        ("rpn", RegionProposalNetwork, ExtRegionProposalNetwork),
        ("roi_heads", RoIHeads, ExtRoIHeads),
    ):
        module = getattr(model, name)
        if type(module) is replacement:
            continue
        if type(module) is not expected:
            raise TypeError(
                f"model.{name} is a {type(module).__qualname__}, not torchvision's {expected.__qualname__}"
                "; use_extension_ops only converts torchvision's own heads. Call lit_amp_det.ops from your "
                "subclass instead, or leave out the ext_ops speedup (speedups.ext_ops=null)."
            )
        module.__class__ = replacement
        module.box_similarity = box_iou
    heads = model.roi_heads
    for attr in ("box_roi_pool", "mask_roi_pool"):
        pooler = getattr(heads, attr, None)
        if isinstance(pooler, TorchvisionMultiScaleRoIAlign):
            setattr(heads, attr, _lit_pooler(pooler))
    return model

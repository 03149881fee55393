"""Runs torchvision's R-CNN heads on lit_amp_det's own ops.

:class:`ExtRegionProposalNetwork` and :class:`ExtRoIHeads` are torchvision's RPN and RoI heads with a few
methods re-implemented around :mod:`lit_amp_det.ops`: NMS that stops at the number of boxes kept afterwards
(``post_nms_top_n`` proposals, ``detections_per_img`` detections), the fused fp32 IoU for the matchers, one
RoIAlign call for a training batch's mask targets (:mod:`lit_amp_det.models.mask_targets`), fewer host syncs
(none: :mod:`.sync_free`). The rules they share with the fixed-shape heads (labels, candidate filters, losses)
are the functions of :mod:`lit_amp_det.models.detection_core`. They add no parameters or buffers:
:func:`use_extension_ops` builds them from a torchvision model's heads (``from_rpn``, ``from_roi_heads``: the
same submodules and settings), so ``state_dict`` keys, checkpoints and the fp32 regions are unchanged. The
poolers become :class:`lit_amp_det.ops.MultiScaleRoIAlign` (level scales carried over); the losses are
torchvision's up to float rounding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models.detection.generalized_rcnn import GeneralizedRCNN
from torchvision.models.detection.roi_heads import RoIHeads
from torchvision.models.detection.rpn import RegionProposalNetwork
from torchvision.ops import MultiScaleRoIAlign as TorchvisionMultiScaleRoIAlign

from lit_amp_det.models.detection_core import (
    background_labels,
    box_head_losses,
    detection_candidates,
    labels_from_matches,
    proposal_candidates,
    top_proposals_per_level,
)
from lit_amp_det.models.mask_targets import maskrcnn_loss
from lit_amp_det.ops import MultiScaleRoIAlign, batched_nms, box_iou

__all__ = ["ExtRegionProposalNetwork", "ExtRoIHeads", "lit_pooler", "use_extension_ops", "uses_extension_ops"]


def _check_convertible(module: nn.Module, expected: type[nn.Module], replacement: type[nn.Module]) -> None:
    """Refuses to rebuild a subclass of torchvision's head: its own behaviour would be silently dropped."""
    if not isinstance(module, replacement) and type(module) is not expected:
        raise TypeError(
            f"{type(module).__qualname__} is not torchvision's {expected.__qualname__}; lit_amp_det builds "
            "its heads from torchvision's own. Call lit_amp_det.ops from your subclass instead, or turn off "
            "the speedups that rebuild the heads (speedups.ext_ops=null speedups.sync_free=null)."
        )


def _rpn_settings(rpn: RegionProposalNetwork) -> dict[str, Any]:
    """The keyword arguments that build an RPN like ``rpn`` (its submodules and settings)."""
    return dict(
        anchor_generator=rpn.anchor_generator,
        head=rpn.head,
        fg_iou_thresh=rpn.proposal_matcher.high_threshold,
        bg_iou_thresh=rpn.proposal_matcher.low_threshold,
        batch_size_per_image=rpn.fg_bg_sampler.batch_size_per_image,
        positive_fraction=rpn.fg_bg_sampler.positive_fraction,
        pre_nms_top_n=dict(rpn._pre_nms_top_n),
        post_nms_top_n=dict(rpn._post_nms_top_n),
        nms_thresh=rpn.nms_thresh,
        score_thresh=rpn.score_thresh,
    )


def lit_pooler(pooler: nn.Module | None) -> nn.Module | None:
    """torchvision's ``MultiScaleRoIAlign`` as :class:`lit_amp_det.ops.MultiScaleRoIAlign` (same levels and
    scales); any other pooler, or None, as it is.

    Args:
        pooler: a RoI heads' pooler, or None where the heads have none.

    Returns:
        The pooler to build lit_amp_det's heads with.
    """
    if not isinstance(pooler, TorchvisionMultiScaleRoIAlign):
        return pooler
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


def _roi_heads_settings(heads: RoIHeads) -> dict[str, Any]:
    """The keyword arguments that build RoI heads like ``heads`` (its submodules, its settings, and
    lit_amp_det's poolers).
    """
    return dict(
        box_roi_pool=lit_pooler(heads.box_roi_pool),
        box_head=heads.box_head,
        box_predictor=heads.box_predictor,
        fg_iou_thresh=heads.proposal_matcher.high_threshold,
        bg_iou_thresh=heads.proposal_matcher.low_threshold,
        batch_size_per_image=heads.fg_bg_sampler.batch_size_per_image,
        positive_fraction=heads.fg_bg_sampler.positive_fraction,
        bbox_reg_weights=heads.box_coder.weights,
        score_thresh=heads.score_thresh,
        nms_thresh=heads.nms_thresh,
        detections_per_img=heads.detections_per_img,
        mask_roi_pool=lit_pooler(heads.mask_roi_pool),
        mask_head=heads.mask_head,
        mask_predictor=heads.mask_predictor,
        keypoint_roi_pool=heads.keypoint_roi_pool,
        keypoint_head=heads.keypoint_head,
        keypoint_predictor=heads.keypoint_predictor,
    )


class ExtRegionProposalNetwork(RegionProposalNetwork):
    """torchvision's RPN; proposal filtering stops NMS at ``post_nms_top_n`` and matching uses the fused IoU.

    Takes ``RegionProposalNetwork``'s arguments; :meth:`from_rpn` builds one from a built RPN.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.box_similarity = box_iou

    @classmethod
    def from_rpn(cls, rpn: RegionProposalNetwork) -> ExtRegionProposalNetwork:
        """This class's RPN with ``rpn``'s anchor generator, head (the same modules: weights are shared, not
        copied), settings and training mode.

        Args:
            rpn: torchvision's ``RegionProposalNetwork`` or one of lit_amp_det's.

        Returns:
            A new RPN of this class; ``rpn`` itself if it already is one (or a subclass, such as the
            fixed-shape RPN).

        Raises:
            TypeError: ``rpn`` is a subclass of torchvision's RPN that lit_amp_det does not know.
        """
        if isinstance(rpn, cls):
            return rpn
        _check_convertible(rpn, RegionProposalNetwork, ExtRegionProposalNetwork)
        built = cls(**_rpn_settings(rpn))
        built.min_size = rpn.min_size
        return built.train(rpn.training)

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
        boxes, scores, levels = top_proposals_per_level(
            proposals,
            objectness,
            num_anchors_per_level,
            self.pre_nms_top_n(),
        )
        candidates = [
            proposal_candidates(image_boxes, image_scores, shape, self.min_size, self.score_thresh)
            for image_boxes, image_scores, shape in zip(boxes, scores, image_shapes)
        ]
        return self.nms_per_image(candidates, scores, levels)

    def nms_per_image(
        self,
        candidates: list[tuple[Tensor, Tensor]],
        scores: Tensor,
        levels: Tensor,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Each image's candidates gathered (one host sync each, for their count), then NMS per level.

        Args:
            candidates: per image, :func:`~lit_amp_det.models.detection_core.proposal_candidates`' clipped
                boxes ``[T, 4]`` and bool ``usable [T]``.
            scores (Tensor[B, T]): the boxes' objectness probabilities.
            levels (Tensor[T], int64): the FPN level of each column.

        Returns:
            Per image, the kept proposals ``[K_i, 4]`` and their scores ``[K_i]``.
        """
        kept_boxes, kept_scores = [], []
        for (image_boxes, usable), image_scores in zip(candidates, scores):
            keep = torch.where(usable)[0]
            image_boxes, image_scores, image_levels = image_boxes[keep], image_scores[keep], levels[keep]
            keep = batched_nms(
                image_boxes,
                image_scores,
                image_levels,
                self.nms_thresh,
                max_output=self.post_nms_top_n(),
            )
            kept_boxes.append(image_boxes[keep])
            kept_scores.append(image_scores[keep])
        return kept_boxes, kept_scores


def _check_target_types(targets: list[dict[str, Tensor]]) -> None:
    """torchvision's ``RoIHeads.forward`` checks of the targets' dtypes, with its messages."""
    for t in targets:
        if t["boxes"].dtype not in (torch.float, torch.double, torch.half):
            raise TypeError(f"target boxes must of float type, instead got {t['boxes'].dtype}")
        if t["labels"].dtype != torch.int64:
            raise TypeError(f"target labels must of int64 type, instead got {t['labels'].dtype}")


class ExtRoIHeads(RoIHeads):
    """torchvision's RoI heads; proposal matching uses the fused IoU, detection NMS stops at
    ``detections_per_img``, the box and mask losses are :mod:`~lit_amp_det.models.detection_core`'s, and a
    training step crops the mask targets of all images with one RoIAlign call.

    Takes ``RoIHeads``' arguments; :meth:`from_roi_heads` builds one from built heads.
    ``batched_mask_targets`` (class attribute; set it on an instance to A/B) switches the mask targets back to
    torchvision's per-image ``project_masks_on_boxes`` (torchvision's training branch).
    """

    batched_mask_targets: bool = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.box_similarity = box_iou

    @classmethod
    def from_roi_heads(cls, heads: RoIHeads) -> ExtRoIHeads:
        """This class's heads with ``heads``' submodules (the same modules: weights are shared, not copied),
        settings and training mode; torchvision's poolers become lit_amp_det's (:func:`lit_pooler`).

        Args:
            heads: torchvision's ``RoIHeads`` or lit_amp_det's.

        Returns:
            New heads of this class; ``heads`` itself if they already are (or a subclass, such as the
            fixed-shape heads).

        Raises:
            TypeError: ``heads`` is a subclass of torchvision's ``RoIHeads`` that lit_amp_det does not know.
        """
        if isinstance(heads, cls):
            return heads
        _check_convertible(heads, RoIHeads, ExtRoIHeads)
        built = cls(**_roi_heads_settings(heads))
        if "batched_mask_targets" in vars(heads):  # an instance's A/B choice stays
            built.batched_mask_targets = heads.batched_mask_targets
        return built.train(heads.training)

    def forward(
        self,
        features: dict[str, Tensor],
        proposals: list[Tensor],
        image_shapes: list[tuple[int, int]],
        targets: list[dict[str, Tensor]] | None = None,
    ) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
        """torchvision's ``RoIHeads.forward``; training box and mask heads (without keypoints) takes
        :meth:`_training_losses`.
        """
        own_training = not self.has_keypoint() and (self.batched_mask_targets or not self.has_mask())
        if self.training and own_training:
            return [], self._training_losses(features, proposals, image_shapes, targets)
        return super().forward(features, proposals, image_shapes, targets)

    def _training_losses(
        self,
        features: dict[str, Tensor],
        proposals: list[Tensor],
        image_shapes: list[tuple[int, int]],
        targets: list[dict[str, Tensor]] | None,
    ) -> dict[str, Tensor]:
        """The training branch of torchvision's forward for box and mask heads, step for step, with the
        losses of :func:`~lit_amp_det.models.detection_core.box_head_losses` and
        :func:`lit_amp_det.models.mask_targets.maskrcnn_loss` (one RoIAlign call for the batch's targets).
        """
        if targets is None:  # torchvision's select_training_samples says the same
            raise ValueError("targets should not be None")
        _check_target_types(targets)
        proposals, matched_idxs, labels, regression_targets = self.select_training_samples(proposals, targets)
        box_features = self.box_head(self.box_roi_pool(features, proposals, image_shapes))
        class_logits, box_regression = self.box_predictor(box_features)
        loss_classifier, loss_box_reg = box_head_losses(
            class_logits,
            box_regression,
            torch.cat(labels),
            torch.cat(regression_targets),
        )
        losses = {"loss_classifier": loss_classifier, "loss_box_reg": loss_box_reg}
        if self.has_mask():
            losses["loss_mask"] = self._mask_loss(
                features, proposals, matched_idxs, labels, image_shapes, targets
            )
        return losses

    def _mask_loss(
        self,
        features: dict[str, Tensor],
        proposals: list[Tensor],
        matched_idxs: list[Tensor],
        labels: list[Tensor],
        image_shapes: list[tuple[int, int]],
        targets: list[dict[str, Tensor]],
    ) -> Tensor:
        """The mask loss over each image's positive samples (gathered: one host sync per image)."""
        positives = [torch.where(image_labels > 0)[0] for image_labels in labels]
        mask_proposals = [boxes[pos] for boxes, pos in zip(proposals, positives)]
        pos_matched_idxs = [idxs[pos] for idxs, pos in zip(matched_idxs, positives)]
        mask_features = self.mask_head(self.mask_roi_pool(features, mask_proposals, image_shapes))
        gt_masks = [t["masks"] for t in targets]
        gt_labels = [t["labels"] for t in targets]
        return maskrcnn_loss(
            self.mask_predictor(mask_features),
            mask_proposals,
            gt_masks,
            gt_labels,
            pos_matched_idxs,
        )

    def assign_targets_to_proposals(
        self,
        proposals: list[Tensor],
        gt_boxes: list[Tensor],
        gt_labels: list[Tensor],
    ) -> tuple[list[Tensor], list[Tensor]]:
        """Matched ground-truth index and class (0 background, -1 ignored) of every proposal
        (:func:`~lit_amp_det.models.detection_core.labels_from_matches`).
        """
        assigned = [
            self._assign(image_proposals, image_gt_boxes, image_gt_labels)
            for image_proposals, image_gt_boxes, image_gt_labels in zip(proposals, gt_boxes, gt_labels)
        ]
        return [matched for matched, _ in assigned], [labels for _, labels in assigned]

    def _assign(self, proposals: Tensor, gt_boxes: Tensor, gt_labels: Tensor) -> tuple[Tensor, Tensor]:
        if gt_boxes.numel() == 0:  # background-only image
            return background_labels(proposals.shape[0], proposals.device)
        matches = self.proposal_matcher(box_iou(gt_boxes, proposals))
        return labels_from_matches(matches, gt_labels, self.proposal_matcher)

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
        self,
        boxes: Tensor,
        scores: Tensor,
        image_shape: tuple[int, int],
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One image's candidates gathered (one host sync, for their count), then NMS per class."""
        boxes, scores, labels, usable = detection_candidates(boxes, scores, image_shape, self.score_thresh)
        keep = torch.where(usable)[0]
        boxes, scores, labels = boxes[keep], scores[keep], labels[keep]
        keep = batched_nms(boxes, scores, labels, self.nms_thresh, max_output=self.detections_per_img)
        return boxes[keep], scores[keep], labels[keep]


def uses_extension_ops(model: nn.Module) -> bool:
    """Whether ``model``'s RPN and RoI heads run on lit_amp_det's ops (:func:`use_extension_ops`, or the
    fixed-shape heads built on them).

    Args:
        model: a detector (anything with ``rpn`` and ``roi_heads``), or any module.

    Returns:
        True when its ``rpn`` is an :class:`ExtRegionProposalNetwork` and its ``roi_heads`` an
        :class:`ExtRoIHeads`.
    """
    rpn = getattr(model, "rpn", None)
    heads = getattr(model, "roi_heads", None)
    return isinstance(rpn, ExtRegionProposalNetwork) and isinstance(heads, ExtRoIHeads)


def use_extension_ops(model: GeneralizedRCNN) -> GeneralizedRCNN:
    """Gives a torchvision Faster/Mask R-CNN lit_amp_det's RPN and RoI heads, built from its own
    (:meth:`ExtRegionProposalNetwork.from_rpn`, :meth:`ExtRoIHeads.from_roi_heads`: the same submodules and
    settings); returns it.

    Args:
        model: a torchvision ``GeneralizedRCNN`` (its ``rpn`` and ``roi_heads`` are replaced).

    Returns:
        ``model``, with new ``rpn`` and ``roi_heads`` modules; its ``state_dict`` keys are unchanged.

    Raises:
        TypeError: the RPN or the RoI heads are a subclass of torchvision's: their own behaviour would be
            dropped.
    """
    for name, build in (
        ("rpn", ExtRegionProposalNetwork.from_rpn),
        ("roi_heads", ExtRoIHeads.from_roi_heads),
    ):
        try:
            setattr(model, name, build(getattr(model, name)))
        except TypeError as err:
            raise TypeError(f"model.{name}: {err}") from None
    return model

"""Builds torchvision Mask R-CNN / Faster R-CNN models from plain configuration values.

Everything a user would sweep (backbone depth, FPN width, image sizes, anchors, RPN and RoI-head settings,
head widths) is an argument here, so the Hydra ``model`` node maps one to one onto these functions and
:class:`lit_amp_det.MaskRCNNModule` stays free of construction details. Pretrained weights are named as
torchvision names them (``"IMAGENET1K_V1"`` for a trunk, ``"COCO_V1"`` for a detector) and fetched by
:mod:`lit_amp_det.models.weights`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn
from torchvision.models import WeightsEnum, resnet
from torchvision.models.detection import FasterRCNN, MaskRCNN
from torchvision.models.detection.backbone_utils import BackboneWithFPN
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.ops import MultiScaleRoIAlign
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool
from torchvision.ops.poolers import initLevelMapper  # not in torchvision's __all__; pinned and tested

from lit_amp_det.errors import ArgumentError
from lit_amp_det.models.anchors import FullPrecisionAnchorGenerator
from lit_amp_det.models.ext_ops import use_extension_ops
from lit_amp_det.models.norms import FrozenBatchNorm2d
from lit_amp_det.models.sync_free import fixed_shape_detector
from lit_amp_det.models.weights import (
    BACKBONE_WEIGHTS,
    NO_WEIGHTS,
    DetectionCheckpoint,
    WeightsMismatchError,
    architecture_mismatches,
    detection_checkpoint,
    load_backbone_weights,
    load_detection_weights,
    resolve_weights,
)

__all__ = ["BACKBONES", "NORM_LAYERS", "build_backbone", "build_detector"]

log = logging.getLogger(__name__)


def _resnet10(*, weights: None = None, **kwargs: Any) -> resnet.ResNet:
    """A one-block-per-stage ResNet: the small, fast trunk for tests and CPU runs."""
    return resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1], **kwargs)


#: Backbone trunks by config name. ``resnet10`` is the small fast option.
BACKBONES: dict[str, Callable[..., resnet.ResNet]] = {
    "resnet10": _resnet10,
    "resnet18": resnet.resnet18,
    "resnet34": resnet.resnet34,
    "resnet50": resnet.resnet50,
    "resnet101": resnet.resnet101,
}

#: Normalisation layers by config name. ``frozen_bn`` is a buffers-only BatchNorm (a subclass of
#: torchvision's) that keeps bf16/fp16 activations in their dtype under autocast.
NORM_LAYERS: dict[str, Callable[..., nn.Module]] = {"bn": nn.BatchNorm2d, "frozen_bn": FrozenBatchNorm2d}

_STAGES_BY_DEPTH = ["layer4", "layer3", "layer2", "layer1", "conv1"]


def _backbone_weights(name: str, weights: str | None) -> WeightsEnum | None:
    """The torchvision enum member that ``weights`` names for trunk ``name``, or None."""
    if weights in NO_WEIGHTS:
        return None
    if name not in BACKBONE_WEIGHTS:
        raise ArgumentError(
            "weights",
            weights,
            f"cannot be used: torchvision publishes no weights for name={name!r} "
            f"(lit_amp_det's own small trunk); pretrained trunks are {sorted(BACKBONE_WEIGHTS)}, "
            "or set it to null",
        )
    return resolve_weights(BACKBONE_WEIGHTS[name], str(weights), "weights")


def _detection_weights(weights: str | None, mask: bool) -> tuple[DetectionCheckpoint, WeightsEnum] | None:
    """The torchvision checkpoint family and member that ``weights`` names, or None."""
    if weights in NO_WEIGHTS:
        return None
    family = detection_checkpoint(mask)
    try:
        return family, resolve_weights(family.enum, str(weights), "weights")
    except ArgumentError as err:  # the module also takes a local file here: say how one is told apart
        raise ArgumentError(
            err.argument,
            err.value,
            f"{err.problem}; a local file needs a directory part or a .ckpt/.pt/.pth ending (./model.pt)",
        ) from None


def build_backbone(
    name: str = "resnet18",
    *,
    fpn_channels: int = 256,
    trainable_layers: int = 5,
    norm: str = "bn",
    returned_layers: Sequence[int] = (1, 2, 3, 4),
    weights: str | None = None,
    load_weights: bool = True,
) -> BackboneWithFPN:
    """Builds a ResNet trunk with an FPN on top.

    Args:
        name: one of :data:`BACKBONES`.
        fpn_channels: channels of every FPN output (torchvision uses 256; 64 is plenty for small data).
        trainable_layers: how many stages, counted from the top (layer4 ... conv1), get gradients;
            5 trains everything, 0 freezes the whole trunk.
        norm: one of :data:`NORM_LAYERS`.
        returned_layers: which ResNet stages (1..4) feed the FPN.
        weights: ImageNet weights of the trunk by torchvision's name: a member of its weight enum
            (:data:`lit_amp_det.models.weights.BACKBONE_WEIGHTS`: ``IMAGENET1K_V1``, ``IMAGENET1K_V2``) or
            ``DEFAULT``; None for random initialisation. Loaded into the trunk before it is frozen, into
            whichever norm layers ``norm`` gives (frozen ones included), from torch hub's cache.
        load_weights: False checks ``weights`` but leaves the trunk at its initialisation, for a caller that
            loads other tensors over it (a detection checkpoint, a local checkpoint).

    Returns:
        torchvision's ``BackboneWithFPN``: the trunk's ``returned_layers`` feeding an FPN of ``fpn_channels``
        channels, plus a max-pooled level.

    Raises:
        ArgumentError: a setting is unknown or out of range, or ``weights`` names no weights of the trunk.
    """
    if name not in BACKBONES:
        raise ArgumentError("name", name, f"is unknown; choose one of {sorted(BACKBONES)}")
    if norm not in NORM_LAYERS:
        raise ArgumentError("norm", norm, f"is unknown; choose one of {sorted(NORM_LAYERS)}")
    if not 0 <= trainable_layers <= 5:
        raise ArgumentError("trainable_layers", trainable_layers, "must be in [0, 5]")
    if not returned_layers or not all(1 <= k <= 4 for k in returned_layers):
        raise ArgumentError("returned_layers", list(returned_layers), "must be stages in 1..4")
    pretrained = _backbone_weights(name, weights)

    trunk = BACKBONES[name](weights=None, norm_layer=NORM_LAYERS[norm])
    if pretrained is not None and load_weights:
        load_backbone_weights(trunk, pretrained, "weights", str(weights))
    trained = _STAGES_BY_DEPTH[:trainable_layers] + (["bn1"] if trainable_layers == 5 else [])
    for param_name, param in trunk.named_parameters():
        if not any(param_name.startswith(stage) for stage in trained):
            param.requires_grad_(False)

    stage1_channels = trunk.inplanes // 8
    return BackboneWithFPN(
        trunk,
        return_layers={f"layer{k}": str(i) for i, k in enumerate(returned_layers)},
        in_channels_list=[stage1_channels * 2 ** (k - 1) for k in returned_layers],
        out_channels=fpn_channels,
        extra_blocks=LastLevelMaxPool(),
    )


def build_detector(
    num_classes: int,
    *,
    mask: bool = True,
    backbone: Mapping[str, Any] | None = None,
    transform: Mapping[str, Any] | None = None,
    rpn: Mapping[str, Any] | None = None,
    roi_heads: Mapping[str, Any] | None = None,
    weights: str | None = None,
    load_weights: bool = True,
    fixed_shape: bool = False,
    instances_per_image: int | None = None,
) -> FasterRCNN:
    """Builds a torchvision Mask R-CNN (``mask=True``) or Faster R-CNN (``mask=False``) on torchvision's ops.

    lit_amp_det's kernels are an implementation choice applied afterwards
    (:class:`lit_amp_det.models.speedups.ExtensionOps`), as is the fixed-shape computation
    (:class:`~lit_amp_det.models.speedups.SyncFree`), which ``fixed_shape`` builds here instead.

    Args:
        num_classes: number of classes including background.
        mask: a Mask R-CNN (with the mask head) when True, a Faster R-CNN when False.
        backbone: keyword arguments of :func:`build_backbone`.
        transform: ``min_size``, ``max_size``, ``image_mean``, ``image_std``, ``size_divisible``.
        rpn: ``anchor_sizes`` (one per FPN level), ``aspect_ratios``, ``pre_nms_top_n_train/test``,
            ``post_nms_top_n_train/test``, ``nms_thresh``, ``fg_iou_thresh``, ``bg_iou_thresh``,
            ``batch_size_per_image``, ``positive_fraction``, ``score_thresh``.
        roi_heads: ``box_head_width``, ``box_score_thresh``, ``box_nms_thresh``, ``detections_per_img``,
            ``fg_iou_thresh``, ``bg_iou_thresh``, ``batch_size_per_image``, ``positive_fraction``,
            ``mask_head_layers`` (channels per mask-head conv), ``sampling_ratio``.
        weights: a torchvision COCO checkpoint by name (``COCO_V1`` or ``DEFAULT``): of
            ``MaskRCNN_ResNet50_FPN_Weights`` for a Mask R-CNN, of ``FasterRCNN_ResNet50_FPN_Weights`` for a
            Faster R-CNN, whose architecture the other arguments must match
            (``conf/model/maskrcnn_r50_fpn.yaml``). With another ``num_classes`` than the checkpoint's 91, the
            class-dependent predictor layers keep their fresh initialisation and everything else is loaded. It
            includes the trunk, so ``backbone.weights`` is then checked but not loaded (as torchvision does).
        load_weights: False checks ``weights`` and ``backbone.weights`` (names and architecture) but loads
            neither, for a caller that loads other tensors over them (a local checkpoint).
        fixed_shape: build the fixed-shape detector
            (:func:`lit_amp_det.models.sync_free.fixed_shape_detector`, on lit_amp_det's ops): the same
            parameters and ``state_dict`` keys, shapes fixed by these settings.
        instances_per_image: with ``fixed_shape``, the instance count every training target is padded to
            (:class:`~lit_amp_det.models.sync_free.SyncFreeMaskRCNN`); None keeps each image's count.

    Returns:
        The detector: torchvision's ``MaskRCNN`` or ``FasterRCNN``, or with ``fixed_shape`` its fixed-shape
        subclass (:class:`~lit_amp_det.models.sync_free.SyncFreeMaskRCNN`,
        :class:`~lit_amp_det.models.sync_free.SyncFreeFasterRCNN`).

    Raises:
        ArgumentError: a setting is unknown or out of range, or ``weights`` names no checkpoint, or
            ``instances_per_image`` is given without ``fixed_shape``.
        WeightsMismatchError: ``weights`` names a checkpoint whose architecture the settings do not match.
    """
    if num_classes < 2:
        raise ArgumentError("num_classes", num_classes, "must count background plus at least one class")
    if instances_per_image is not None and not fixed_shape:
        raise ArgumentError(
            "instances_per_image",
            instances_per_image,
            "pads the fixed-shape detector's targets: set fixed_shape",
        )
    pretrained = _detection_weights(weights, mask)
    backbone_cfg = dict(backbone or {})
    if pretrained is not None and load_weights and backbone_cfg.get("weights") not in NO_WEIGHTS:
        log.info(
            "weights=%r holds the trunk too: backbone.weights=%r is not loaded",
            weights,
            backbone_cfg.get("weights"),
        )
    try:
        body = build_backbone(**backbone_cfg, load_weights=load_weights and pretrained is None)
    except ArgumentError as err:
        raise err.at("backbone") from None
    returned_layers = backbone_cfg.get("returned_layers", (1, 2, 3, 4))
    levels = len(returned_layers) + 1  # + LastLevelMaxPool
    channels = body.out_channels
    rpn_cfg = dict(rpn or {})
    roi_cfg = dict(roi_heads or {})
    tf_cfg = dict(transform or {})

    aspect_ratios = rpn_cfg.pop("aspect_ratios", (0.5, 1.0, 2.0))
    sizes = rpn_cfg.pop("anchor_sizes", (32, 64, 128, 256, 512))
    if (
        len(sizes) != levels
    ):  # one anchor size per FPN level, every aspect ratio on each; fp32 under mixed precision
        raise ArgumentError(
            "rpn.anchor_sizes",
            list(sizes),
            f"has {len(sizes)} entries but the FPN has {levels} levels; give one size per level",
        )
    anchors = FullPrecisionAnchorGenerator(
        sizes=tuple((int(s),) for s in sizes), aspect_ratios=(tuple(aspect_ratios),) * levels
    )
    feature_names = [str(i) for i in range(levels - 1)]
    sampling_ratio = roi_cfg.pop("sampling_ratio", 2)
    box_width = roi_cfg.pop("box_head_width", 1024)
    mask_layers = tuple(roi_cfg.pop("mask_head_layers", (256, 256, 256, 256)))
    if pretrained is not None:
        configured = {
            "backbone.name": backbone_cfg.get("name", "resnet18"),
            "backbone.fpn_channels": channels,
            "backbone.returned_layers": list(returned_layers),
            "rpn.aspect_ratios": list(aspect_ratios),
            "roi_heads.box_head_width": box_width,
            "roi_heads.mask_head_layers": list(mask_layers),
        }
        family = pretrained[0]
        mismatches = architecture_mismatches(family, configured)
        if mismatches:  # fail before anything is fetched when the model cannot hold the checkpoint's tensors
            raise WeightsMismatchError(
                "weights",
                weights,
                f"names torchvision's {family.builder} checkpoint "
                f"({family.enum.__name__}), which this model does not match: "
                f"{', '.join(mismatches)}. Use model=maskrcnn_r50_fpn "
                f"(mask={str(family.mask).lower()}) or set those values, or set it to null",
            )
    box_pool = MultiScaleRoIAlign(feature_names, output_size=7, sampling_ratio=sampling_ratio)

    kwargs: dict[str, Any] = dict(
        min_size=tf_cfg.pop("min_size", 800),
        max_size=tf_cfg.pop("max_size", 1333),
        image_mean=tf_cfg.pop("image_mean", None),
        image_std=tf_cfg.pop("image_std", None),
        size_divisible=tf_cfg.pop("size_divisible", 32),
        rpn_anchor_generator=anchors,
        box_roi_pool=box_pool,
        box_head=TwoMLPHead(channels * 7 * 7, box_width),
        box_predictor=FastRCNNPredictor(box_width, num_classes),
        **{_rpn_kwarg(k, v): v for k, v in rpn_cfg.items()},
        **{_roi_kwarg(k, v): v for k, v in roi_cfg.items()},
    )
    if tf_cfg:
        raise ArgumentError("transform", dict(tf_cfg), f"has unknown keys {sorted(tf_cfg)}")
    if not mask:
        detector = FasterRCNN(body, num_classes=None, **kwargs)
    else:
        mask_pool = MultiScaleRoIAlign(feature_names, output_size=14, sampling_ratio=sampling_ratio)
        detector = MaskRCNN(
            body,
            num_classes=None,
            mask_roi_pool=mask_pool,
            mask_head=MaskRCNNHeads(channels, mask_layers, 1),
            mask_predictor=MaskRCNNPredictor(mask_layers[-1], mask_layers[-1], num_classes),
            **kwargs,
        )
    _fix_pooler_scales(detector, returned_layers)
    if pretrained is not None and load_weights:
        load_detection_weights(detector, pretrained[1], num_classes, "weights", str(weights))
    if fixed_shape:
        return fixed_shape_detector(use_extension_ops(detector), instances_per_image)
    return detector


def _fix_pooler_scales(detector: FasterRCNN, returned_layers: Sequence[int]) -> None:
    """Sets the poolers' level scales from the backbone's strides (ResNet stage k: stride 2 ** (k + 1)).

    torchvision infers them from the first batch it pools, by the height ratio alone, which is a power of two
    off when that batch is much wider than tall; the strides are known here, so neither op set has to guess.
    """
    scales = [2.0 ** -(k + 1) for k in returned_layers]
    for pooler in (detector.roi_heads.box_roi_pool, getattr(detector.roi_heads, "mask_roi_pool", None)):
        if pooler is None:
            continue
        level_scales = [scales[int(name)] for name in pooler.featmap_names]
        pooler.scales = level_scales
        k_min, k_max = round(-math.log2(level_scales[0])), round(-math.log2(level_scales[-1]))
        # torchvision's pooler skips its own inference only when it has both the scales and a level mapper
        pooler.map_levels = initLevelMapper(
            k_min, k_max, canonical_scale=pooler.canonical_scale, canonical_level=pooler.canonical_level
        )


_ROI_KWARGS = {
    "box_score_thresh",
    "box_nms_thresh",
    "box_detections_per_img",
    "box_fg_iou_thresh",
    "box_bg_iou_thresh",
    "box_batch_size_per_image",
    "box_positive_fraction",
    "bbox_reg_weights",
}
_RPN_KWARGS = {
    "pre_nms_top_n_train",
    "pre_nms_top_n_test",
    "post_nms_top_n_train",
    "post_nms_top_n_test",
    "nms_thresh",
    "fg_iou_thresh",
    "bg_iou_thresh",
    "batch_size_per_image",
    "positive_fraction",
    "score_thresh",
}


def _rpn_kwarg(key: str, value: Any) -> str:
    if key not in _RPN_KWARGS:
        raise ArgumentError(f"rpn.{key}", value, f"is not a known RPN setting; known: {sorted(_RPN_KWARGS)}")
    return f"rpn_{key}"


def _roi_kwarg(key: str, value: Any) -> str:
    """Maps config names (``fg_iou_thresh``, ``detections_per_img`` ...) onto torchvision's ``box_*``
    names.
    """
    name = key if key.startswith("box_") or key == "bbox_reg_weights" else f"box_{key}"
    if name not in _ROI_KWARGS:
        raise ArgumentError(
            f"roi_heads.{key}", value, f"is not a known RoI-head setting; known: {sorted(_ROI_KWARGS)}"
        )
    return name

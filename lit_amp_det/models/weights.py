"""Pretrained weights by name, through torchvision's weight enums and torch hub's file cache.

``model.backbone.weights=IMAGENET1K_V1`` names a member of the trunk's torchvision enum,
``model.weights=COCO_V1`` a member of the enum of the torchvision detection checkpoint whose architecture the
model has (:data:`DETECTION_CHECKPOINTS`). Files are fetched as torchvision fetches them (``torch.hub``): a
file already in ``$TORCH_HOME/hub/checkpoints/`` is loaded without the network, and a download is checked
against its hash, so an offline machine works once the file is copied there; otherwise one
:class:`WeightsUnavailableError` names the file, the URL and the folder. A COCO checkpoint loaded into a model
with another class count loads everything but the class-dependent predictor layers (:data:`CLASS_DEPENDENT`):
the usual fine-tuning start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import Tensor, nn
from torchvision.models import (
    ResNet18_Weights,
    ResNet34_Weights,
    ResNet50_Weights,
    ResNet101_Weights,
    WeightsEnum,
)
from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights, MaskRCNN_ResNet50_FPN_Weights

from lit_amp_det.errors import ArgumentError

__all__ = [
    "NO_WEIGHTS",
    "BACKBONE_WEIGHTS",
    "CLASS_DEPENDENT",
    "DETECTION_CHECKPOINTS",
    "DetectionCheckpoint",
    "WeightsMismatchError",
    "WeightsUnavailableError",
    "architecture_mismatches",
    "cached_file",
    "detection_checkpoint",
    "fetch_state_dict",
    "load_backbone_weights",
    "load_detection_weights",
    "resolve_weights",
]

log = logging.getLogger(__name__)

#: torchvision's ImageNet weight enum of each trunk (``resnet10`` is lit_amp_det's own and has none).
BACKBONE_WEIGHTS: dict[str, type[WeightsEnum]] = {
    "resnet18": ResNet18_Weights,
    "resnet34": ResNet34_Weights,
    "resnet50": ResNet50_Weights,
    "resnet101": ResNet101_Weights,
}

#: Detector tensors whose shape follows the class count: re-initialised when fine-tuning on other classes.
CLASS_DEPENDENT = (
    "roi_heads.box_predictor.cls_score.",
    "roi_heads.box_predictor.bbox_pred.",
    "roi_heads.mask_predictor.mask_fcn_logits.",
)

#: Values of a ``weights`` argument that mean "no pretrained weights" (YAML's null and its spellings).
NO_WEIGHTS = (None, "", "none", "None", "null")


@dataclass(frozen=True)
class DetectionCheckpoint:
    """A torchvision detection checkpoint family and the model settings its tensors were trained with.

    Attributes:
        builder: torchvision's function that builds the architecture, for messages.
        enum: its weight enum.
        mask: whether it has the mask branch (Mask R-CNN) or not (Faster R-CNN).
        architecture: config key -> value the model must have for every tensor to fit (and mean the same).
    """

    builder: str
    enum: type[WeightsEnum]
    mask: bool
    architecture: Mapping[str, Any]


# rpn.aspect_ratios: the RPN head's outputs per location are these anchors, in this order (sizes only scale a
# level)
_R50_FPN = {
    "backbone.name": "resnet50",
    "backbone.fpn_channels": 256,
    "backbone.returned_layers": [1, 2, 3, 4],
    "rpn.aspect_ratios": [0.5, 1.0, 2.0],
    "roi_heads.box_head_width": 1024,
}

#: The torchvision checkpoints whose architecture :func:`lit_amp_det.models.build_detector` can build (the
#: ``_v2`` families are left out: their heads are not built here).
DETECTION_CHECKPOINTS: dict[str, DetectionCheckpoint] = {
    "maskrcnn_resnet50_fpn": DetectionCheckpoint(
        "maskrcnn_resnet50_fpn",
        MaskRCNN_ResNet50_FPN_Weights,
        mask=True,
        architecture={**_R50_FPN, "roi_heads.mask_head_layers": [256, 256, 256, 256]},
    ),
    "fasterrcnn_resnet50_fpn": DetectionCheckpoint(
        "fasterrcnn_resnet50_fpn", FasterRCNN_ResNet50_FPN_Weights, mask=False, architecture=_R50_FPN
    ),
}


class WeightsUnavailableError(ArgumentError, FileNotFoundError):
    """Named weights that are not in the cache and could not be downloaded (or are in it but unreadable); its
    ``repr`` is the message, as Hydra reports errors raised inside ``instantiate`` by their ``repr``.

    Args:
        argument: the setting that named the weights (``weights``, ``backbone.weights``).
        value: the name it gave.
        problem: what went wrong and what to do about it.
    """

    def __repr__(self) -> str:
        return f"{type(self).__name__}: {self}"


class WeightsMismatchError(ArgumentError):
    """Named weights whose tensors do not fit the model built from the arguments (``repr``: the message).

    Args:
        argument: the setting that named the weights (``weights``, ``backbone.weights``).
        value: the name it gave.
        problem: which of the model's settings differ from the checkpoint's architecture.
    """

    def __repr__(self) -> str:
        return f"{type(self).__name__}: {self}"


def resolve_weights(enum: type[WeightsEnum], name: str, argument: str) -> WeightsEnum:
    """The member of ``enum`` called ``name`` (``"IMAGENET1K_V1"``, ``"DEFAULT"`` or
    ``"ResNet50_Weights.DEFAULT"``); an unknown name is an :class:`ArgumentError` on ``argument`` that lists
    the valid ones.
    """
    member = str(name).removeprefix(f"{enum.__name__}.")
    if member not in enum.__members__:
        raise ArgumentError(
            argument,
            name,
            f"is not one of torchvision's {enum.__name__}; choose one of "
            f"{list(enum.__members__)} (DEFAULT is {enum.DEFAULT.name}), or null for no pretrained "
            "weights",
        )
    return enum[member]


def detection_checkpoint(mask: bool) -> DetectionCheckpoint:
    """The checkpoint family a Mask R-CNN (``mask=True``) or Faster R-CNN takes its ``weights`` from."""
    return next(c for c in DETECTION_CHECKPOINTS.values() if c.mask == mask)


def architecture_mismatches(checkpoint: DetectionCheckpoint, configured: Mapping[str, Any]) -> list[str]:
    """``"backbone.fpn_channels=64 (needs 256)"`` for every setting that differs from the checkpoint's;
    ``configured`` maps the names of ``checkpoint.architecture`` to the model's effective values.
    """
    return [
        f"{key}={_as_override(configured.get(key))} (needs {_as_override(value)})"
        for key, value in checkpoint.architecture.items()
        if _normalised(configured.get(key)) != _normalised(value)
    ]


def _normalised(value: Any) -> Any:
    """Lists and tuples compare alike (``[0.5, 1, 2]`` equals ``(0.5, 1.0, 2.0)``)."""
    return list(value) if isinstance(value, (list, tuple)) else value


def _as_override(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return str(value)


def cached_file(weights: WeightsEnum) -> Path:
    """Where torch hub keeps ``weights``: ``torch.hub.get_dir()/checkpoints/<file name of its URL>``."""
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(weights.url).path)


def fetch_state_dict(weights: WeightsEnum, argument: str, name: str) -> dict[str, Tensor]:
    """``weights``' state dict, from the torch hub cache or downloaded into it (``weights_only`` loading).

    ``argument`` and ``name`` (the argument and the name it was given) are for messages. Raises
    :class:`WeightsUnavailableError` naming the file, URL and folder when the file is not cached and the
    download fails, or when a cached file cannot be read.
    """
    path = cached_file(weights)
    was_cached = path.is_file()
    try:
        state = weights.get_state_dict(progress=True, check_hash=True, weights_only=True)
    except Exception as err:  # urllib, ssl, socket, hash and unpickling errors all end here
        if was_cached or path.is_file():
            # torch's own text for an unreadable file suggests weights_only=False: not advice to pass on
            with path.open("rb") as handle:
                head = handle.read(8)
            raise WeightsUnavailableError(
                argument,
                name,
                f"cannot be loaded: the cached file {path} is unreadable ({type(err).__name__}; "
                f"{path.stat().st_size} bytes starting with {head!r}): it is truncated or not the published "
                "checkpoint. Delete it to download it again, or replace it with a complete copy of "
                f"{weights.url}",
            ) from err
        raise WeightsUnavailableError(
            argument,
            name,
            f"needs {path.name}, which is not in the torch hub cache, and downloading it "
            f"from {weights.url} failed ({type(err).__name__}: {err}). On a machine without internet "
            f"access, download that URL elsewhere and put the file into {path.parent}/ (the folder "
            "follows $TORCH_HOME), "
            "or set it to null",
        ) from err
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise WeightsUnavailableError(
            argument,
            name,
            f"cannot be loaded: {path} holds a {type(state).__name__}, not a state dict of tensors; "
            f"delete it and let it download again, or replace it with a copy of {weights.url}",
        )
    return dict(state)


def _check_fit(
    module: nn.Module,
    state: Mapping[str, Tensor],
    argument: str,
    name: str,
    path: Path,
    allowed_missing: Sequence[str] = (),
) -> None:
    """Raises :class:`WeightsMismatchError` unless every tensor of ``state`` fits ``module`` and only step
    counters and ``allowed_missing`` prefixes are absent from it.
    """
    own = module.state_dict()
    missing = [
        k
        for k in own
        if k not in state
        and not k.endswith(".num_batches_tracked")
        and not k.startswith(tuple(allowed_missing))
    ]
    unexpected = [k for k in state if k not in own and not k.endswith(".num_batches_tracked")]
    shapes = [
        f"{k} {list(state[k].shape)} in the file, {list(own[k].shape)} here"
        for k in state
        if k in own and state[k].shape != own[k].shape
    ]
    problems = [
        f"{len(keys)} tensors {kind} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
        for kind, keys in (
            ("missing from the file", missing),
            ("unknown to the model", unexpected),
            ("of other shapes", shapes),
        )
        if keys
    ]
    if problems:
        raise WeightsMismatchError(
            argument,
            name,
            f"does not fit the model: {path.name} has {'; '.join(problems)}. The file is "
            f"not the one torchvision publishes under that name, or the model settings differ from its "
            f"architecture; replace the file with a copy of the published one, or set it to null",
        )


def load_backbone_weights(trunk: nn.Module, weights: WeightsEnum, argument: str, name: str) -> None:
    """Loads ImageNet ``weights`` into a torchvision ResNet ``trunk`` (classifier included), as torchvision
    does.

    The trunk's norms may be ``BatchNorm2d`` or ``FrozenBatchNorm2d``: both start from the same statistics.
    """
    state = fetch_state_dict(weights, argument, name)
    _check_fit(trunk, state, argument, name, cached_file(weights))
    trunk.load_state_dict(state, strict=False)  # only step counters can be absent: checked above
    log.info(
        "%s=%r: loaded %s (%s, %d tensors)", argument, name, cached_file(weights).name, weights, len(state)
    )


def load_detection_weights(
    detector: nn.Module, weights: WeightsEnum, num_classes: int, argument: str, name: str
) -> None:
    """Loads a torchvision detection checkpoint into ``detector`` (built for ``num_classes``).

    With the checkpoint's own class count everything is loaded; with another, the :data:`CLASS_DEPENDENT`
    predictor layers keep their fresh initialisation, everything else is loaded, and one log line says so.
    """
    state = fetch_state_dict(weights, argument, name)
    path = cached_file(weights)
    trained_classes = len(weights.meta["categories"])
    skipped: list[str] = []
    if num_classes != trained_classes:
        skipped = [k for k in state if k.startswith(CLASS_DEPENDENT)]
        state = {k: v for k, v in state.items() if k not in skipped}
    _check_fit(detector, state, argument, name, path, allowed_missing=CLASS_DEPENDENT if skipped else ())
    detector.load_state_dict(state, strict=False)  # only step counters and the skipped layers can be absent
    if skipped:
        layers = sorted({k.rsplit(".", 1)[0] for k in skipped})
        log.info(
            "%s=%r: loaded %d tensors of %s (%s); %s re-initialised for %d classes (the checkpoint has %d)",
            argument,
            name,
            len(state),
            path.name,
            weights,
            ", ".join(layers),
            num_classes,
            trained_classes,
        )
    else:
        log.info("%s=%r: loaded %s (%s, %d tensors)", argument, name, path.name, weights, len(state))

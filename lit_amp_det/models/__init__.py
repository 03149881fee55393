"""Detector construction from configuration values, and pretrained weights by torchvision name."""

from lit_amp_det.models.maskrcnn import BACKBONES, NORM_LAYERS, build_backbone, build_detector
from lit_amp_det.models.weights import (
    BACKBONE_WEIGHTS,
    DETECTION_CHECKPOINTS,
    WeightsMismatchError,
    WeightsUnavailableError,
)

__all__ = [
    "BACKBONES",
    "BACKBONE_WEIGHTS",
    "DETECTION_CHECKPOINTS",
    "NORM_LAYERS",
    "WeightsMismatchError",
    "WeightsUnavailableError",
    "build_backbone",
    "build_detector",
]

"""Detector construction from configuration values."""

from lit_amp_det.models.maskrcnn import BACKBONES, NORM_LAYERS, build_backbone, build_detector

__all__ = ["BACKBONES", "NORM_LAYERS", "build_backbone", "build_detector"]

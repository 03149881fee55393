"""Data: COCO-format datasets and data modules, the embedded synthetic "shapes" dataset, transforms."""

from lit_amp_det.data.coco import CocoInstances
from lit_amp_det.data.datamodule import CocoDataModule, ShapesDataModule
from lit_amp_det.data.shapes import SHAPE_CLASSES, ensure_shapes, generate_shapes

__all__ = [
    "CocoInstances",
    "CocoDataModule",
    "ShapesDataModule",
    "SHAPE_CLASSES",
    "ensure_shapes",
    "generate_shapes",
]

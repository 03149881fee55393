"""Writes ``predict`` output as a COCO results file that ``pycocotools``' ``loadRes`` accepts.

Masks are run-length encoded batch by batch, so memory stays flat however many images are predicted. The first
``num_images`` images are also drawn with their detections into ``<dirpath>/<images_dirname>/<image id>.png``.
Images from a folder without annotations (``data.predict_images``) are drawn as ``<image id>_<file
stem>.png``, and ``<results stem>_images.json`` beside the results holds the COCO ``images`` and
``categories`` of the run, so the two files read as a COCO dataset with its results.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pycocotools.mask as mask_utils
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter

from lit_amp_det.callbacks.drawing import DrawingWarning, class_names_of, draw_detections, save_png

__all__ = ["CocoPredictionWriter"]


class CocoPredictionWriter(BasePredictionWriter):
    """Collects ``predict_step`` outputs into ``<dirpath>/<filename>`` (COCO detection results).

    Pictures of the first ``num_images`` images with their detections go to ``<dirpath>/<images_dirname>/``,
    one ``<image id>.png`` each (under DDP, the first images of rank zero's shard). A picture that cannot be
    drawn is reported with a :class:`~lit_amp_det.callbacks.drawing.DrawingWarning`; the results file is
    written all the same.

    Args:
        dirpath: output folder (the run directory by default).
        filename: results file name.
        score_threshold: detections below this score are not written.
        num_images: images drawn with their detections; 0 draws none.
        images_dirname: folder of the pictures, inside ``dirpath``.
        image_score_threshold: detections below this score are not drawn (the results file keeps down to
            ``score_threshold``, for mAP; a picture of those would be covered in low-score boxes); ``None``:
            ``score_threshold``.
        min_side: images with a shorter side below this are drawn enlarged by an integer factor (whole pixels)
        so
            that captions stay readable; 0 keeps their size.
        max_side: images with a longer side above this are drawn shrunk to it (a phone photo's picture at full
            size costs gigabytes of masks to draw); 0 keeps their size.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike,
        filename: str = "predictions.json",
        score_threshold: float = 0.0,
        num_images: int = 16,
        images_dirname: str = "predictions",
        image_score_threshold: float | None = 0.5,
        min_side: int = 256,
        max_side: int = 1333,
    ) -> None:
        super().__init__(write_interval="batch")
        if isinstance(num_images, bool) or not isinstance(num_images, int) or num_images < 0:
            raise ValueError(
                f"callbacks.prediction_writer.num_images={num_images!r} must be an integer >= 0 "
                "(images drawn with their detections; 0 draws none)"
            )
        for name, side in (("min_side", min_side), ("max_side", max_side)):
            if isinstance(side, bool) or not isinstance(side, int) or side < 0:
                raise ValueError(
                    f"callbacks.prediction_writer.{name}={side!r} must be an integer >= 0 (pixels; 0 "
                    "keeps the images' size)"
                )
        self.path = Path(dirpath) / filename
        self.score_threshold, self.num_images = score_threshold, num_images
        self.images_dir = Path(dirpath) / images_dirname
        self.image_score_threshold = (
            score_threshold if image_score_threshold is None else image_score_threshold
        )
        if max_side and min_side > max_side:
            raise ValueError(
                f"callbacks.prediction_writer.min_side={min_side} is above max_side={max_side}: no "
                "picture can be both; lower min_side or raise max_side"
            )
        self.min_side, self.max_side = min_side, max_side
        self.images_path = self.path.with_name(f"{self.path.stem}_images.json")
        self._records: list[dict[str, Any]] = []
        self._images: list[dict[str, Any]] = []  # COCO image records of images that came with a file name
        self._images_left = 0  # set by on_predict_start: pictures belong to a predict run

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._records, self._images = [], []
        self._images_left = self.num_images if trainer.is_global_zero else 0

    def write_on_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        images = batch[0] if isinstance(batch, (tuple, list)) and batch else None
        for index, det in enumerate(prediction):
            self._records.extend(self._image_records(det))
            if "file_name" in det and images is not None:
                height, width = images[index].shape[-2:]
                self._images.append(
                    {
                        "id": det["image_id"],
                        "file_name": det["file_name"],
                        "height": int(height),
                        "width": int(width),
                    }
                )
        if self._images_left:
            self._draw_batch(pl_module, prediction, batch)

    def _draw_batch(self, pl_module: LightningModule, prediction: list[dict[str, Any]], batch: Any) -> None:
        """Pictures of the batch's first images. ``batch`` is ``(images, targets)`` as the loader gave it: the
        dataset's images, whose pixel coordinates the detections are in (torchvision's transform maps them
        back from the resized input).
        """
        if (
            not isinstance(batch, (tuple, list))
            or not batch
            or not isinstance(batch[0], (tuple, list, torch.Tensor))
        ):
            warnings.warn(
                f"predict: no pictures: the batch is a {type(batch).__name__}, not (images, targets)",
                DrawingWarning,
                stacklevel=2,
            )
            self._images_left = 0
            return
        images = batch[0]
        names = class_names_of(pl_module)
        for image, det in zip(images[: self._images_left], prediction):
            name = (
                f"{det['image_id']}_{Path(det['file_name']).stem}.png"
                if "file_name" in det
                else f"{det.get('image_id', self.num_images - self._images_left)}.png"
            )
            self._images_left -= 1
            try:
                picture = draw_detections(
                    image,
                    det,
                    names,
                    self.image_score_threshold,
                    min_side=self.min_side,
                    max_side=self.max_side,
                )
                save_png(picture, self.images_dir / name)
            except Exception as err:  # a picture is not worth the results file
                warnings.warn(
                    f"predict: no picture {self.images_dir / name}: {type(err).__name__}: {err}",
                    DrawingWarning,
                    stacklevel=2,
                )

    def _image_records(self, det: dict[str, Any]) -> list[dict[str, Any]]:
        """One image's detections above the threshold as COCO result records (one device->host copy per
        field).
        """
        keep = det["scores"] >= self.score_threshold
        boxes = det["boxes"][keep].tolist()
        scores = det["scores"][keep].tolist()
        categories = det.get("category_ids", det["labels"])[keep].tolist()
        records = [
            {
                "image_id": det["image_id"],
                "category_id": int(category),
                "bbox": [x1, y1, x2 - x1, y2 - y1],
                "score": float(score),
            }
            for (x1, y1, x2, y2), score, category in zip(boxes, scores, categories)
        ]
        if "masks" in det and records:
            masks = det["masks"]
            masks = masks.reshape(len(masks), *masks.shape[-2:])
            # one mask at a time: pycocotools takes a Fortran-ordered [H, W, n] uint8 stack, which for all N
            # masks at once is an N-image copy on top of the masks
            for record, index in zip(records, keep.nonzero().flatten().tolist()):
                plane = masks[index].to(device="cpu", dtype=torch.uint8).numpy()
                (rle,) = mask_utils.encode(np.asfortranarray(plane[:, :, None]))
                record["segmentation"] = {"size": rle["size"], "counts": rle["counts"].decode("ascii")}
        return records

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        parts: list[Any] = [(self._records, self._images)]
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            parts = [None] * trainer.world_size
            torch.distributed.all_gather_object(parts, (self._records, self._images))
        if not trainer.is_global_zero:
            return
        _write_json(self.path, [r for records, _ in parts for r in records])
        images = sorted((i for _, part in parts for i in part), key=lambda image: image["id"])
        if images:
            _write_json(self.images_path, {"images": images, "categories": _categories(pl_module)})


#: The name torchvision's COCO weights give the category ids COCO does not use (12, 26, 29, ...): no category.
UNUSED_CATEGORY_NAME = "N/A"


def _categories(pl_module: LightningModule) -> list[dict[str, Any]]:
    """COCO ``categories`` of the model's classes: the ids the results carry (the dataset's category ids, else
    the labels 1..K) with their names. The ids torchvision's COCO weights name ``N/A`` are left out: COCO's
    own annotation files list only its 80 used ids, and such a label is never a detection of something.
    """
    names = class_names_of(pl_module)
    hparams = getattr(pl_module, "hparams", {})
    category_ids = hparams.get("category_ids") if hasattr(hparams, "get") else None
    count = len(category_ids) if category_ids else len(names)
    categories = [
        {
            "id": int(category_ids[k]) if category_ids else k + 1,
            "name": names[k] if k < len(names) else str(k + 1),
        }
        for k in range(count)
    ]
    return [category for category in categories if category["name"] != UNUSED_CATEGORY_NAME]


def _write_json(path: Path, data: Any) -> None:
    """Written whole or not at all (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)

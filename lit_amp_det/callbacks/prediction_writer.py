"""Writes ``predict`` output as a COCO results file that ``pycocotools``' ``loadRes`` accepts.

Masks are run-length encoded batch by batch, so memory stays flat however many images are predicted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pycocotools.mask as mask_utils
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter

__all__ = ["CocoPredictionWriter"]


class CocoPredictionWriter(BasePredictionWriter):
    """Collects ``predict_step`` outputs into ``<dirpath>/<filename>`` (COCO detection results).

    Args:
        dirpath: output folder (the run directory by default).
        filename: results file name.
        score_threshold: detections below this score are not written.
    """

    def __init__(self, dirpath: str | os.PathLike, filename: str = "predictions.json",
                 score_threshold: float = 0.0) -> None:
        super().__init__(write_interval="batch")
        self.path = Path(dirpath) / filename
        self.score_threshold = score_threshold
        self._records: list[dict[str, Any]] = []

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._records = []

    def write_on_batch_end(self, trainer: Trainer, pl_module: LightningModule, prediction: Any,
                           batch_indices: Any, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        for det in prediction:
            self._records.extend(self._image_records(det))

    def _image_records(self, det: dict[str, Any]) -> list[dict[str, Any]]:
        """One image's detections above the threshold as COCO result records (one device->host copy per field)."""
        keep = det["scores"] >= self.score_threshold
        boxes = det["boxes"][keep].tolist()
        scores = det["scores"][keep].tolist()
        categories = det.get("category_ids", det["labels"])[keep].tolist()
        records = [
            {"image_id": det["image_id"], "category_id": int(category), "bbox": [x1, y1, x2 - x1, y2 - y1],
             "score": float(score)}
            for (x1, y1, x2, y2), score, category in zip(boxes, scores, categories)
        ]
        if "masks" in det and records:
            masks = det["masks"][keep].reshape(len(records), *det["masks"].shape[-2:])
            # pycocotools encodes a Fortran-ordered [H, W, N] stack in one call
            stack = np.asfortranarray(masks.to(torch.uint8).permute(1, 2, 0).cpu().numpy())
            for record, rle in zip(records, mask_utils.encode(stack)):
                record["segmentation"] = {"size": rle["size"], "counts": rle["counts"].decode("ascii")}
        return records

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        records: list[Any] = [self._records]
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            records = [None] * trainer.world_size
            torch.distributed.all_gather_object(records, self._records)
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps([r for part in records for r in part]))
            os.replace(tmp, self.path)

"""Pictures of the first validation images at every validation of ``fit``: ground truth beside the
predictions.

A few predictions show what mAP does not: masks that bleed, boxes on the background, classes swapped. The
module's ``validation_step`` returns nothing, so this callback runs the forward itself on the first
``num_images`` images of the first validation batches, on rank zero (one extra forward of those images per
validation). The pictures go to TensorBoard when it is configured, otherwise to PNG files in the run folder.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lit_amp_det.callbacks.drawing import (
    DrawingWarning,
    class_names_of,
    draw_detections,
    draw_ground_truth,
    save_png,
    side_by_side,
)

__all__ = ["ValidationImages"]

_FIELD = "callbacks.validation_images"


class ValidationImages(Callback):
    """Draws ground truth (left) and predictions (right) of the first validation images at each validation.

    With a :class:`~lightning.pytorch.loggers.TensorBoardLogger`, each picture is an image summary
    ``val_images/<image id>`` at the current global step. PNG files go to
    ``<dirpath>/val_images/epoch<EEE>-step<SSSSSS>/<image id>.png``: with ``png="auto"`` when no TensorBoard
    logger is configured, always with ``True``, never with ``False``.

    Runs during ``fit`` and ``validate`` on rank zero, not during the sanity check. A picture that cannot be
    drawn is reported with a :class:`~lit_amp_det.callbacks.drawing.DrawingWarning` and the run goes on.

    Args:
        dirpath (str or Path): folder that receives ``val_images/`` (the run folder).
        num_images (int): images drawn per validation (taken from the first batches); 0 draws none.
            Default: 4.
        score_threshold (float): detections scoring below it are not drawn; in [0, 1]. Default: 0.5.
        png (bool or str): ``"auto"``, ``True`` or ``False``: whether PNG files are written (see above).
            Default: ``"auto"``.
        min_side (int): images with a shorter side below this are enlarged by an integer factor (whole
            pixels) so that captions stay readable; 0 keeps their size. Default: 256.

    Raises:
        ValueError: in ``setup()`` (the constructor only stores the values), if ``num_images`` or
            ``min_side`` is not an integer >= 0, ``score_threshold`` is not a number in [0, 1], or ``png`` is
            not ``"auto"``, ``True`` or ``False``.
    """

    def __init__(
        self,
        dirpath: str | Path,
        num_images: int = 4,
        score_threshold: float = 0.5,
        png: str | bool = "auto",
        min_side: int = 256,
    ) -> None:
        self.dirpath = Path(dirpath)
        self.num_images, self.score_threshold, self.png, self.min_side = (
            num_images,
            score_threshold,
            png,
            min_side,
        )
        self._pictures: list[tuple[str, torch.Tensor]] = []
        self._active = False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(self.num_images, bool) or not isinstance(self.num_images, int) or self.num_images < 0:
            raise ValueError(
                f"{_FIELD}.num_images={self.num_images!r} must be an integer >= 0 (images drawn per "
                "validation; 0 draws none)"
            )
        if (
            isinstance(self.score_threshold, bool)
            or not isinstance(self.score_threshold, (int, float))
            or not 0.0 <= self.score_threshold <= 1.0
        ):
            raise ValueError(
                f"{_FIELD}.score_threshold={self.score_threshold!r} must be a number in [0, 1] "
                "(detections scoring below it are not drawn)"
            )
        if not (isinstance(self.png, bool) or self.png == "auto"):
            raise ValueError(
                f"{_FIELD}.png={self.png!r}; choose auto (PNG files when no TensorBoard logger is "
                "configured), true or false"
            )
        if isinstance(self.min_side, bool) or not isinstance(self.min_side, int) or self.min_side < 0:
            raise ValueError(
                f"{_FIELD}.min_side={self.min_side!r} must be an integer >= 0 (pixels; 0 keeps the "
                "images' size)"
            )

    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pictures = []
        self._active = (
            self.num_images > 0
            and trainer.is_global_zero
            and not trainer.sanity_checking
            and trainer.state.fn in (TrainerFn.FITTING, TrainerFn.VALIDATING)
        )

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self._active or dataloader_idx != 0:
            return
        try:
            self._draw_batch(trainer, pl_module, batch)
        except Exception as err:  # a picture is not worth the run
            self._active = False
            warnings.warn(
                f"validation at step {trainer.global_step}: no pictures this time: "
                f"{type(err).__name__}: {err}",
                DrawingWarning,
                stacklevel=2,
            )

    def _draw_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> None:
        images, targets = batch
        wanted = self.num_images - len(self._pictures)
        images, targets = list(images[:wanted]), list(targets[:wanted])
        # the precision plugin's context, as Lightning runs validation_step (autocast; half weights need it)
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            predictions = pl_module(images)
        names = class_names_of(pl_module)
        for image, target, prediction in zip(images, targets, predictions, strict=True):
            picture = side_by_side(
                [
                    draw_ground_truth(image, target, names, min_side=self.min_side),
                    draw_detections(image, prediction, names, self.score_threshold, min_side=self.min_side),
                ],
                ["ground truth", f"predictions (score >= {self.score_threshold:g})"],
            )
            name = str(int(target["image_id"])) if "image_id" in target else str(len(self._pictures))
            self._pictures.append((name, picture))
        self._active = len(self._pictures) < self.num_images

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._pictures:
            return
        pictures, self._pictures = self._pictures, []
        boards = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        for board in boards:
            for name, picture in pictures:
                board.experiment.add_image(
                    f"val_images/{name}", picture, global_step=trainer.global_step, dataformats="CHW"
                )
        if self.png is True or (self.png == "auto" and not boards):
            folder = (
                self.dirpath
                / "val_images"
                / f"epoch{trainer.current_epoch:03d}-step{trainer.global_step:06d}"
            )
            for name, picture in pictures:
                save_png(picture, folder / f"{name}.png")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_images={self.num_images}, score_threshold={self.score_threshold}, "
            f"png={self.png!r}, min_side={self.min_side})"
        )

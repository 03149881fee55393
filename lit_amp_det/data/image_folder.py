"""A folder of pictures without annotations, for ``predict`` on new images (``data.predict_images``).

What a user does after training: run the detector on unlabelled images, as MMDetection's ``image_demo`` or
detectron2's ``demo.py --input folder/*`` do. The images are every file directly in the folder whose suffix
names an image format (:data:`IMAGE_SUFFIXES`, any case), in file-name order; image ``k`` of that order gets
the id ``k + 1`` (kept when ``data.bad_images=skip`` leaves an unreadable picture out), which the detections
in ``predictions.json`` carry, and the prediction writer records each id's file name and size. Pictures are
turned as their EXIF orientation tag says, as detectron2's ``read_image`` and OpenCV's ``imread``
(MMDetection) do: a phone photo taken upright is often stored sideways with such a tag, and detections, sizes
and drawings then refer to the picture as a viewer shows it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lit_amp_det.data.image_io import read_rgb_image

__all__ = ["IMAGE_SUFFIXES", "ImageFolder"]

#: File suffixes read as images (compared in lower case).
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")


class ImageFolder(Dataset):
    """The images directly in ``folder`` (sub-folders are not entered), sorted by file name.

    Items are ``(image, target)`` as the COCO datasets give them, so the evaluation loaders and the prediction
    writer take them unchanged: ``image`` uint8 ``[3, H, W]`` RGB, ``target`` ``{"image_id", "file_name"}``
    (no boxes). A file that cannot be decoded fails when it is read, naming it.

    Args:
        folder: the folder of pictures (``~`` expanded; relative to the working directory).
        source: the config key that named it, for messages.
    """

    def __init__(self, folder: str | os.PathLike, source: str = "data.predict_images") -> None:
        path = Path(folder).expanduser()
        if not path.is_dir():
            what = "is a file" if path.is_file() else "does not exist"
            raise FileNotFoundError(
                f"{source}={str(folder)!r} {what}: pass the folder that holds the pictures to predict"
            )
        self.folder = path.resolve()
        self.files = sorted(
            p for p in self.folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
        )
        if not self.files:
            raise FileNotFoundError(
                f"{source}={str(folder)!r} holds no pictures (files ending in "
                f"{', '.join(IMAGE_SUFFIXES)}, directly in the folder)"
            )
        self.ids = list(range(1, len(self.files) + 1))

    def drop(self, paths: Iterable[str | os.PathLike]) -> int:
        """Leaves the pictures at ``paths`` out (unreadable ones); the others keep their ids. Returns how
        many.
        """
        bad = {str(Path(p)) for p in paths}
        kept = [(path, image_id) for path, image_id in zip(self.files, self.ids) if str(path) not in bad]
        removed = len(self.files) - len(kept)
        self.files, self.ids = [path for path, _ in kept], [image_id for _, image_id in kept]
        return removed

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Any]]:
        image = read_rgb_image(
            self.files[index], apply_exif_orientation=True
        )  # as a viewer shows a phone photo
        image_id = torch.tensor(self.ids[index], dtype=torch.int64)
        return image, {"image_id": image_id, "file_name": self.files[index].name}

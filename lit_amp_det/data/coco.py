"""COCO-format instance-segmentation dataset for the Mask R-CNN / Faster R-CNN training loop.

`CocoInstances` reads any folder laid out the COCO way (an image directory plus an ``instances_*.json`` file),
validates the whole annotation file once at construction, so bad records fail early with a message naming the
file, the record and the fix, and precomputes per-image arrays so ``__getitem__`` only decodes the image and
masks. Items follow the torchvision detection convention: a uint8 ``[3, H, W]`` RGB image and a target dict
with xyxy ``boxes``, contiguous ``labels`` (1..K, 0 is background), ``masks``, ``image_id``, ``area`` and
``iscrowd``. Crowd regions stay in the target because COCO evaluation needs them; `drop_crowd` removes them
before the target reaches the model.
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pycocotools import mask as mask_utils
from torch import Tensor

from lit_amp_det.data.coco_format import (
    compressed_rle_runs,
    index_with_pycocotools,
    is_number,
    load_annotation_file,
    runs_problem,
    segmentation_problem,
)
from lit_amp_det.data.image_io import read_rgb_image

__all__ = [
    "INVALID_BOX_MODES",
    "CocoInstances",
    "PER_INSTANCE_KEYS",
    "drop_crowd",
    "pad_instances",
    "read_rgb_image",
]

#: What ``invalid_boxes`` may say: stop at the first degenerate box, or leave such annotations out.
INVALID_BOX_MODES = ("error", "skip")

logger = logging.getLogger(__name__)

#: Target fields with one entry per instance (first dimension N); code removing instances must index them
#: together.
PER_INSTANCE_KEYS: tuple[str, ...] = ("boxes", "labels", "masks", "area", "iscrowd")

_MAX_LISTED_MISSING = 5
_SKIP_HINT = "set data.invalid_boxes=skip to drop such boxes"
_NUMPY_COPY_WARNING = "__array__ implementation doesn't accept a copy keyword"


@dataclass
class _ImageRecord:
    """Everything `__getitem__` needs for one image, computed once at construction."""

    image_id: int
    path: Path
    width: int
    height: int
    boxes: np.ndarray  # float32 [N, 4] xyxy, already clipped to the image
    labels: np.ndarray  # int64 [N], contiguous 1..K
    areas: np.ndarray  # float32 [N]
    iscrowd: np.ndarray  # int64 [N]
    segmentations: list[Any] = field(default_factory=list)
    annotation_ids: list[int] = field(default_factory=list)


def drop_crowd(target: dict[str, Tensor]) -> dict[str, Tensor]:
    """Return a copy of ``target`` without ``iscrowd == 1`` instances, which the losses must not treat as
    objects. Every present field in `PER_INSTANCE_KEYS` is filtered with the same mask; other fields pass
    through unchanged.
    """
    out = dict(target)
    if "iscrowd" in target:
        keep = target["iscrowd"] == 0
        for key in PER_INSTANCE_KEYS:
            if key in out:
                out[key] = out[key][keep]
    return out


def pad_instances(target: dict[str, Tensor], count: int) -> dict[str, Tensor]:
    """``target`` with its instances padded to ``count``, so that every training target has the same shapes
    (the static inputs of a fixed-shape step, ``speedups.sync_free``).

    Args:
        target: one image's training target; its fields of `PER_INSTANCE_KEYS` are ``[N, ...]``.
        count: the instance count to pad to (``speedups.sync_free.instances_per_image``, or
            ``data.pad_instances``).

    Returns:
        The target with those fields padded with zeros to ``[count, ...]`` and a bool ``valid`` ``[count]``
        marking the ``N`` real instances.

    Raises:
        ValueError: the target has more than ``count`` instances (the message names its ``image_id``).
    """
    present = target["boxes"].shape[0]
    if present > count:
        raise ValueError(
            f"the padded instance count {count} (speedups.sync_free.instances_per_image, or "
            f"data.pad_instances={count}) is less than the {present} instances of image_id "
            f"{int(target.get('image_id', torch.tensor(-1)))}; raise it, or set it to null"
        )
    out = dict(target)
    for key in PER_INSTANCE_KEYS:
        if key in out:
            out[key] = torch.cat([out[key], out[key].new_zeros((count - present, *out[key].shape[1:]))])
    out["valid"] = torch.arange(count) < present
    return out


class CocoInstances(torch.utils.data.Dataset):
    """Instance-segmentation dataset over any COCO-format folder.

    Args:
        image_dir: folder that the images' ``file_name`` entries are relative to.
        annotation_file: COCO ``instances_*.json`` file.
        transforms: optional ``transforms(image, target) -> (image, target)``.
        with_masks: decode segmentations into a ``masks`` field; ``False`` omits it (Faster R-CNN).
        invalid_boxes: ``"error"`` fails on degenerate boxes (w or h <= 0, non-finite, or completely outside
            the image); ``"skip"`` drops them and counts them in `skipped_boxes`.
        skip_empty: drop images that have no (remaining) annotations from the index.
        category_ids: COCO category ids in label order to reuse another split's label mapping (label
            ``i + 1`` is ``category_ids[i]``); default: this file's categories sorted by id.

    Raises:
        ValueError: ``invalid_boxes`` is not a known mode, or the annotation file is malformed (the message
            names the entry).

    Attributes:
        coco: ``pycocotools.coco.COCO`` index over the file's images, categories and kept annotations, for
            COCOeval; restrict evaluation to `image_ids` when ``skip_empty`` is set.
        category_ids: COCO category ids in contiguous-label order.
        class_names: category names in the same order.
        num_classes: ``len(category_ids) + 1`` (background included).
        image_ids: COCO image ids, one per item, in item order.
        skipped_boxes: degenerate annotations dropped under ``invalid_boxes="skip"``.
        num_instances: kept annotations that are not crowd regions: what training learns from.
    """

    def __init__(
        self,
        image_dir: str | Path,
        annotation_file: str | Path,
        *,
        transforms: Callable[[Tensor, dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]] | None = None,
        with_masks: bool = True,
        invalid_boxes: Literal["error", "skip"] = "error",
        skip_empty: bool = False,
        category_ids: Sequence[int] | None = None,
    ) -> None:
        if invalid_boxes not in INVALID_BOX_MODES:
            modes = " or ".join(map(repr, INVALID_BOX_MODES))
            raise ValueError(f"invalid_boxes must be {modes}, got {invalid_boxes!r}")
        self.image_dir, self.annotation_file, self.transforms = (
            Path(image_dir),
            Path(annotation_file),
            transforms,
        )
        self.with_masks, self.invalid_boxes, self.skip_empty = with_masks, invalid_boxes, skip_empty
        dataset = load_annotation_file(self.annotation_file)
        file_categories = self._check_categories(dataset["categories"])
        self._file_category_ids = set(file_categories)
        # the label mapping: the caller's (shared with another split) or the file's sorted ids
        self.category_ids = ids = (
            sorted(file_categories) if category_ids is None else [int(c) for c in category_ids]
        )
        if len(set(ids)) != len(ids):
            raise ValueError(
                f"category_ids contains duplicates: {ids}; each COCO category id may appear once"
            )
        if category_ids is not None and not ids:
            raise ValueError("category_ids is empty; pass None to use the categories of the annotation file")
        self.class_names = [file_categories.get(cid, f"category_{cid}") for cid in self.category_ids]
        self.num_classes = len(self.category_ids) + 1
        self._label_of = {cid: i + 1 for i, cid in enumerate(self.category_ids)}
        images = self._check_images(dataset["images"])
        self.skipped_boxes = 0
        per_image = self._group_annotations(dataset["annotations"], images)
        if self.skipped_boxes:
            logger.warning(
                "dropped %d degenerate annotation(s) from %s (data.invalid_boxes=skip)",
                self.skipped_boxes,
                self.annotation_file,
            )
        self._records = self._build_records(images, per_image)
        kept = [ann for anns in per_image.values() for ann, _ in anns]
        self.num_instances = sum(not ann.get("iscrowd", 0) for ann in kept)
        self.image_ids = [rec.image_id for rec in self._records]
        if missing := [
            str(rec.path) for rec in self._records if not os.path.exists(rec.path)
        ]:  # fail, listing a few
            listed = ", ".join(missing[:_MAX_LISTED_MISSING])
            more = (
                f" (and {len(missing) - _MAX_LISTED_MISSING} more)"
                if len(missing) > _MAX_LISTED_MISSING
                else ""
            )
            raise FileNotFoundError(
                f"{len(missing)} of {len(self._records)} images listed in {self.annotation_file} "
                f"are missing under {self.image_dir}: {listed}{more}; check data.root and the "
                "split's image folder"
            )
        # Built after validation (pycocotools fails cryptically on bad records) and from the kept annotations
        # only, so COCO evaluation sees the same ground truth as the targets.
        self.coco = index_with_pycocotools({**dataset, "annotations": kept})

    def _check_categories(self, categories: Any) -> dict[int, str]:
        """Return ``{category id: name}`` for the file's ``categories`` list."""
        if not isinstance(categories, list):
            raise ValueError(
                f"'categories' in {self.annotation_file} must be a list, got {type(categories).__name__}"
            )
        names: dict[int, str] = {}
        for position, cat in enumerate(categories):
            cid = self._unique_id(
                cat,
                names,
                "category",
                "categories",
                lambda position=position, cat=cat: (
                    f"category #{position} in {self.annotation_file} has no integer 'id' (got {cat!r}); "
                    "each category must look like {'id': 3, 'name': 'cat'}"
                ),
            )
            names[cid] = str(cat.get("name", f"category_{cid}"))
        return names

    def _unique_id(
        self, record: Any, seen: Container[int], kind: str, section: str, missing: Callable[[], str]
    ) -> int:
        """Return ``record``'s integer id; raise ``missing()`` if it has none, or if ``seen`` holds it
        already.
        """
        if not isinstance(record, dict) or not isinstance(record.get("id"), int):
            raise ValueError(missing())
        if record["id"] in seen:
            raise ValueError(
                f"{kind} id {record['id']} appears twice in '{section}' of {self.annotation_file}"
            )
        return record["id"]

    def _check_images(self, images: Any) -> dict[int, dict[str, Any]]:
        """Validate the ``images`` records and return them keyed by id, in file order."""
        if not isinstance(images, list):
            raise ValueError(
                f"'images' in {self.annotation_file} must be a list, got {type(images).__name__}"
            )
        if not images:
            raise ValueError(f"{self.annotation_file} has no images; check data.root / the split paths")
        by_id: dict[int, dict[str, Any]] = {}
        for position, img in enumerate(images):
            ident = img.get("id", f"#{position}") if isinstance(img, dict) else f"#{position}"
            if not isinstance(img, dict) or not isinstance(img.get("id"), int):
                raise ValueError(
                    f"image record #{position} in {self.annotation_file} has no integer 'id': {img!r}"
                )
            if not isinstance(img.get("file_name"), str):
                raise ValueError(f"image {ident} in {self.annotation_file} has no string 'file_name'")
            for key in ("width", "height"):
                value = img.get(key)
                if not isinstance(value, int) or value <= 0:
                    raise ValueError(
                        f"image {ident} in {self.annotation_file} has {key} {value!r}; "
                        "'width' and 'height' must be positive integers (pixels)"
                    )
            if img["id"] in by_id:
                raise ValueError(f"image id {img['id']} appears twice in 'images' of {self.annotation_file}")
            by_id[img["id"]] = img
        return by_id

    def _group_annotations(
        self, annotations: Any, images: dict[int, dict[str, Any]]
    ) -> dict[int, list[tuple[dict[str, Any], list[float]]]]:
        """Validate every annotation and group ``(annotation, clipped xyxy box)`` by image id."""
        if not isinstance(annotations, list):
            raise ValueError(
                f"'annotations' in {self.annotation_file} must be a list, got {type(annotations).__name__}"
            )
        per_image: dict[int, list[tuple[dict[str, Any], list[float]]]] = {}
        seen_ids: set[int] = set()
        for position, ann in enumerate(annotations):
            ann_id = self._unique_id(
                ann,
                seen_ids,
                "annotation",
                "annotations",
                lambda position=position, ann=ann: (
                    f"annotation #{position} in {self.annotation_file} has no integer 'id' "
                    f"({str(ann)[:80]}); COCO evaluation needs a unique integer id per annotation"
                ),
            )
            seen_ids.add(ann_id)
            if missing := [key for key in ("image_id", "category_id", "bbox") if key not in ann]:
                raise ValueError(
                    f"annotation {ann_id} in {self.annotation_file} has no {' or '.join(missing)} key "
                    f"(its keys: {', '.join(sorted(map(str, ann)))}); a COCO annotation needs image_id, "
                    "category_id and bbox"
                )
            image_id = ann.get("image_id")
            if not isinstance(image_id, int) or image_id not in images:
                raise ValueError(
                    f"annotation {ann_id} in {self.annotation_file} has image_id {image_id!r}, which is "
                    "not in 'images'; fix or remove the annotation (the annotation and image lists are "
                    "out of sync)"
                )
            img = images[image_id]
            cat = ann.get("category_id")
            known_in_file = isinstance(cat, int) and cat in self._file_category_ids
            if not known_in_file or cat not in self._label_of:
                where = "the file's 'categories'" if not known_in_file else "the given category_ids mapping"
                raise ValueError(
                    f"annotation {ann_id} in {self.annotation_file} has category_id {cat!r}, which is "
                    f"not in {where}; known category ids: {self.category_ids}"
                )
            box = self._clipped_box(ann, ann_id, img)
            if box is None or (self.with_masks and not self._segmentation_usable(ann, ann_id, img)):
                self.skipped_boxes += 1
                continue
            per_image.setdefault(img["id"], []).append((ann, box))
        return per_image

    def _clipped_box(self, ann: dict[str, Any], ann_id: Any, img: dict[str, Any]) -> list[float] | None:
        """Convert COCO ``[x, y, w, h]`` to a clipped xyxy box; ``None`` if degenerate and skipping."""
        bbox = ann.get("bbox")
        if not isinstance(bbox, (list, tuple)) or len(bbox) != 4 or not all(is_number(v) for v in bbox):
            raise ValueError(
                f"annotation {ann_id} in {self.annotation_file} has bbox {bbox!r}; "
                "boxes must be a list of 4 numbers [x, y, w, h]"
            )
        x, y, w, h = (float(v) for v in bbox)
        width, height = img["width"], img["height"]
        if not all(math.isfinite(v) for v in (x, y, w, h)):
            problem = f"non-finite bbox {[x, y, w, h]}"
        elif w <= 0:
            problem = f"bbox width {w}"
        elif h <= 0:
            problem = f"bbox height {h}"
        elif x >= width or y >= height or x + w <= 0 or y + h <= 0:
            problem = (
                f"bbox {[x, y, w, h]} completely outside the {width}x{height} image (empty after clipping)"
            )
        else:
            return [
                min(max(x, 0.0), width),
                min(max(y, 0.0), height),
                min(max(x + w, 0.0), width),
                min(max(y + h, 0.0), height),
            ]
        if self.invalid_boxes == "skip":
            return None
        raise ValueError(
            f"annotation {ann_id} (image {img['id']}) in {self.annotation_file} has {problem}; "
            f"boxes must be [x, y, w, h] with w, h > 0 overlapping the image ({_SKIP_HINT})"
        )

    def _segmentation_usable(self, ann: dict[str, Any], ann_id: Any, img: dict[str, Any]) -> bool:
        """Cheap shape check of a segmentation so bad ones fail at construction, not mid-epoch. Malformed
        structure always raises. A degenerate one (fewer than 3 points, no polygon) is treated like a
        degenerate box: an error, or ``False`` (drop the annotation) under ``invalid_boxes="skip"``.
        """
        problem, degenerate = segmentation_problem(ann.get("segmentation"), img["height"], img["width"])
        if problem is None:
            return True
        if degenerate and self.invalid_boxes == "skip":
            return False
        hint = f"; {_SKIP_HINT}" if degenerate else ""
        raise ValueError(
            f"annotation {ann_id} (image {img['id']}) in {self.annotation_file} has a malformed "
            f"segmentation: {problem}; expected polygons [[x1, y1, x2, y2, x3, y3, ...], ...] or RLE "
            "{'size': [height, width], 'counts': ...} (or pass with_masks=False to ignore masks)" + hint
        )

    def _build_records(
        self,
        images: dict[int, dict[str, Any]],
        per_image: dict[int, list[tuple[dict[str, Any], list[float]]]],
    ) -> list[_ImageRecord]:
        """Validated annotations as per-image numpy arrays (no parsing left for `__getitem__`), after
        ``skip_empty``.
        """
        records = []
        for image_id, img in images.items():
            anns = per_image.get(image_id, [])
            if self.skip_empty and not anns:
                continue
            areas = [
                float(ann["area"]) if is_number(ann.get("area")) else (box[2] - box[0]) * (box[3] - box[1])
                for ann, box in anns
            ]
            records.append(
                _ImageRecord(
                    image_id=image_id,
                    path=self.image_dir / img["file_name"],
                    width=img["width"],
                    height=img["height"],
                    boxes=np.asarray([box for _, box in anns], dtype=np.float32).reshape(-1, 4),
                    labels=np.asarray(
                        [self._label_of[ann["category_id"]] for ann, _ in anns], dtype=np.int64
                    ),
                    areas=np.asarray(areas, dtype=np.float32),
                    iscrowd=np.asarray(
                        [1 if ann.get("iscrowd", 0) else 0 for ann, _ in anns], dtype=np.int64
                    ),
                    segmentations=[ann.get("segmentation") for ann, _ in anns] if self.with_masks else [],
                    annotation_ids=[ann["id"] for ann, _ in anns],
                )
            )
        if not records:
            raise ValueError(
                f"{self.annotation_file} has no images with annotations, so skip_empty=True "
                "(data.skip_empty_train=true) leaves no image at all; check data.root / the split paths, "
                "or, to train on negative images only, set data.skip_empty_train=false "
                "data.allow_empty_train=true"
            )
        return records

    def __len__(self) -> int:
        """Number of images in the index (after ``skip_empty``)."""
        return len(self._records)

    def image_info(self, index: int) -> dict[str, Any]:
        """Return (a copy of) the COCO ``images`` record of item ``index``."""
        return dict(self.coco.imgs[self._records[index].image_id])

    def aspect_ratios(self) -> list[float]:
        """Width / height of every item, from the JSON only, for aspect-ratio batch grouping."""
        return [rec.width / rec.height for rec in self._records]

    def __getitem__(self, index: int) -> tuple[Tensor, dict[str, Tensor]]:
        """Decode image ``index`` and build its target; then apply ``transforms`` if set."""
        rec = self._records[index]
        image = read_rgb_image(rec.path)
        if tuple(image.shape[1:]) != (rec.height, rec.width):
            raise ValueError(
                f"image {rec.image_id} ({rec.path}) is {image.shape[2]}x{image.shape[1]} pixels but "
                f"{self.annotation_file} says {rec.width}x{rec.height}; fix the 'width'/'height' of the "
                "image record (annotations are in the JSON's coordinates)"
            )
        target = {
            "boxes": torch.from_numpy(rec.boxes.copy()),
            "labels": torch.from_numpy(rec.labels.copy()),
            "image_id": torch.tensor(rec.image_id, dtype=torch.int64),
            "area": torch.from_numpy(rec.areas.copy()),
            "iscrowd": torch.from_numpy(rec.iscrowd.copy()),
        }
        if self.with_masks:
            target["masks"] = self._decode_masks(rec)
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        return image, target

    def _decode_masks(self, rec: _ImageRecord) -> Tensor:
        """Decode all segmentations of ``rec`` to a uint8 ``[N, H, W]`` tensor."""
        if not rec.segmentations:
            return torch.zeros((0, rec.height, rec.width), dtype=torch.uint8)
        rles = [
            self._to_rle(seg, i, rec) for seg, i in zip(rec.segmentations, rec.annotation_ids, strict=True)
        ]
        try:
            with warnings.catch_warnings():  # pycocotools' Cython predates NumPy 2's __array__(copy=)
                warnings.filterwarnings("ignore", message=_NUMPY_COPY_WARNING, category=DeprecationWarning)
                stacked = mask_utils.decode(rles)  # [H, W, N], Fortran order
        except Exception:  # find and name the offending annotation (rare path)
            for rle, ann_id in zip(rles, rec.annotation_ids, strict=True):
                try:
                    mask_utils.decode(rle)
                except Exception as err:
                    raise self._segmentation_error(ann_id, rec, err) from err
            raise
        return torch.from_numpy(np.ascontiguousarray(stacked.transpose(2, 0, 1)))

    def _to_rle(self, seg: Any, ann_id: Any, rec: _ImageRecord) -> dict[str, Any]:
        """Convert one COCO segmentation (polygons / RLE) to a compressed RLE, naming the annotation on
        failure.
        """
        try:
            if isinstance(seg, list):
                return mask_utils.merge(mask_utils.frPyObjects(seg, rec.height, rec.width))
            if isinstance(seg["counts"], list):
                return mask_utils.frPyObjects(seg, rec.height, rec.width)
            # pycocotools decodes a too-short run list into uninitialised memory, so check first.
            if (
                problem := runs_problem(compressed_rle_runs(seg["counts"]), rec.height, rec.width)
            ) is not None:
                raise ValueError(problem)
            return {"size": list(seg["size"]), "counts": seg["counts"]}
        except Exception as err:  # pycocotools raises bare Exception / ValueError / TypeError
            raise self._segmentation_error(ann_id, rec, err) from err

    def _segmentation_error(self, ann_id: Any, rec: _ImageRecord, err: Exception) -> ValueError:
        """Build the error for a segmentation that passed the structural check but does not decode."""
        return ValueError(
            f"annotation {ann_id} (image {rec.image_id}) in {self.annotation_file} has a segmentation "
            f"pycocotools cannot decode ({err}); fix the polygon / RLE or pass with_masks=False"
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(annotation_file={str(self.annotation_file)!r}, images={len(self)}, "
            f"num_classes={self.num_classes}, with_masks={self.with_masks}, "
            f"skipped_boxes={self.skipped_boxes})"
        )

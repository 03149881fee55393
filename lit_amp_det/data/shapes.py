"""Deterministic synthetic "shapes" instance-segmentation dataset written as real COCO.

Renders small RGB images of coloured shapes on textured backgrounds and writes them in the exact layout of a
COCO dataset (``images/<split>/*.png`` plus ``annotations/instances_<split>.json``), so the default training
path exercises the same COCO loader, mask decoding and evaluation code as real data, without a download:
shapes occlude one another, only their visible region is labelled, and both polygon and compressed-RLE
segmentations occur. Each image has its own PCG64 stream keyed by (seed, split, index), so output is
byte-identical across runs, and the dataset is published with an atomic rename plus a completion marker, so an
interrupted or concurrent generation never looks complete.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from pycocotools import mask as mask_utils

from lit_amp_det.data.shapes_draw import (
    RenderedImage,
    ShapeInstance,
    _rasterise,
    _render,
    render_shapes_image,
)
from lit_amp_det.data.shapes_spec import (
    DEFAULT_SPEC,
    DEFAULT_SPLITS,
    FORMAT_VERSION,
    SHAPE_CLASSES,
    ShapesSpec,
    _make_params,
    _Params,
)

__all__ = [
    "DEFAULT_SPLITS",
    "MARKER_NAME",
    "SHAPE_CLASSES",
    "RenderedImage",
    "ShapeInstance",
    "ensure_shapes",
    "generate_shapes",
    "render_shapes_image",
    "shapes_dataset_dir",
    "ShapesSpec",
]

MARKER_NAME = "DONE"
"""File written last into a dataset dir; its presence means the dataset is complete."""

_PNG_COMPRESS_LEVEL = 1  # faster than the default, files barely larger (noise dominates)


def _clip_polygon(flat: Sequence[float], width: int, height: int) -> list[tuple[float, float]]:
    """Sutherland-Hodgman clip of a polygon to the image rectangle [0, W] x [0, H] (one piece for our shapes:
    each is star-shaped about a centre inside the image).
    """
    points = [(float(flat[i]), float(flat[i + 1])) for i in range(0, len(flat), 2)]
    for axis, bound, keep_above in (
        (0, 0.0, True),
        (0, float(width), False),
        (1, 0.0, True),
        (1, float(height), False),
    ):
        if not points:
            break
        points = _clip_to_half_plane(points, axis, bound, keep_above)
    return points


def _clip_to_half_plane(
    points: Sequence[tuple[float, float]],
    axis: int,
    bound: float,
    keep_above: bool,
) -> list[tuple[float, float]]:
    """One Sutherland-Hodgman step: ``points`` clipped to ``p[axis] >= bound`` (``keep_above``) or
    ``p[axis] <= bound``.
    """

    def inside(p: tuple[float, float]) -> bool:
        return p[axis] >= bound if keep_above else p[axis] <= bound

    def cross(p: tuple[float, float], q: tuple[float, float]) -> tuple[float, float]:
        t = (bound - p[axis]) / (q[axis] - p[axis])
        other = p[1 - axis] + t * (q[1 - axis] - p[1 - axis])
        return (bound, other) if axis == 0 else (other, bound)

    clipped: list[tuple[float, float]] = []
    prev = points[-1]
    for cur in points:
        if inside(cur):
            if not inside(prev):
                clipped.append(cross(prev, cur))
            clipped.append(cur)
        elif inside(prev):
            clipped.append(cross(prev, cur))
        prev = cur
    return clipped


def _polygon_segmentation(inst: ShapeInstance, height: int, width: int) -> list[list[float]] | None:
    """COCO polygon for a fully visible, hole-free instance, or None if RLE is needed; used only if it
    re-rasterises to the visible mask pixel for pixel, so polygon and RLE annotations are equally exact.
    """
    if inst.hole_vertices is not None or not np.array_equal(inst.visible_mask, inst.full_mask):
        return None
    flat: list[float] = []
    for x, y in _clip_polygon(inst.vertices, width, height):
        point = [round(x, 2) + 0.0, round(y, 2) + 0.0]  # + 0.0 turns -0.0 into 0.0
        if flat[-2:] != point:
            flat.extend(point)
    if len(flat) >= 4 and flat[:2] == flat[-2:]:
        del flat[-2:]
    if len(flat) < 6 or not np.array_equal(_rasterise(flat, height, width), inst.visible_mask):
        return None
    return [flat]


def _annotation(inst: ShapeInstance, ann_id: int, image_id: int, height: int, width: int) -> dict[str, Any]:
    """COCO annotation dict for the visible part of one labelled instance."""
    segmentation: Any = _polygon_segmentation(inst, height, width)
    if segmentation is None:  # compressed RLE, with ``counts`` as str so it can go into JSON
        rle = mask_utils.encode(np.asfortranarray(inst.visible_mask.astype(np.uint8)))
        segmentation = {
            "size": [int(rle["size"][0]), int(rle["size"][1])],
            "counts": rle["counts"].decode("ascii"),
        }
    rows, cols = np.flatnonzero(inst.visible_mask.any(axis=1)), np.flatnonzero(inst.visible_mask.any(axis=0))
    x0, x1, y0, y1 = (
        int(cols[0]),
        int(cols[-1]),
        int(rows[0]),
        int(rows[-1]),
    )  # the smallest box holding the mask
    return {
        "id": ann_id,
        "image_id": image_id,
        "category_id": inst.category_id,
        "segmentation": segmentation,
        "area": float(inst.visible_mask.sum()),
        "bbox": [float(x0), float(y0), float(x1 - x0 + 1), float(y1 - y0 + 1)],
        "iscrowd": 0,
    }


def _write_split(params: _Params, root: Path, split: str, count: int) -> dict[str, int]:
    """Render and write one split's PNGs and COCO json; returns image/annotation counts."""
    image_dir = root / "images" / split
    image_dir.mkdir(parents=True, exist_ok=True)
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for index in range(count):
        image_id = index + 1
        rendered = _render(params, split, index)
        file_name = f"{image_id:06d}.png"
        Image.fromarray(rendered.image).save(
            image_dir / file_name, format="PNG", compress_level=_PNG_COMPRESS_LEVEL
        )
        images.append(
            {"id": image_id, "file_name": file_name, "width": params.width, "height": params.height}
        )
        for inst in rendered.instances:
            if inst.labelled:
                annotations.append(
                    _annotation(inst, len(annotations) + 1, image_id, params.height, params.width)
                )
    coco = {
        "info": {
            "description": "lit_amp_det synthetic shapes dataset",
            "version": str(FORMAT_VERSION),
            "year": 2024,
            "contributor": "lit_amp_det.data.shapes",
            "date_created": "",
            "generator": params.to_json(),
        },
        "licenses": [],
        "images": images,
        "annotations": annotations,
        "categories": [
            {"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(SHAPE_CLASSES)
        ],
    }
    ann_dir = root / "annotations"
    ann_dir.mkdir(parents=True, exist_ok=True)
    (ann_dir / f"instances_{split}.json").write_text(
        json.dumps(coco, separators=(",", ":")) + "\n", encoding="utf-8"
    )
    return {"images": len(images), "annotations": len(annotations)}


def _read_marker(root: Path) -> dict[str, Any] | None:
    """The marker's content, or None if the dataset is absent or incomplete."""
    try:
        content = json.loads((root / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def _publish(tmp: Path, root: Path, params_json: dict[str, Any], overwrite: bool) -> None:
    """Atomically move the finished ``tmp`` dataset to ``root``. An existing ``root`` is first renamed aside
    (rename is atomic, rmtree is not), so ``root`` is always absent, the old dataset, or the complete new one.
    Losing a race to a process publishing the same parameters is success.
    """
    for _attempt in range(3):
        if (marker := _read_marker(root)) is not None and not overwrite:
            if marker.get("params") == params_json:
                shutil.rmtree(tmp, ignore_errors=True)  # generation is deterministic: theirs equals ours
                return
            raise FileExistsError(
                f"root {str(root)!r} meanwhile received a shapes dataset with other parameters"
            )
        aside = None
        if root.exists():
            aside = root.with_name(f".{root.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            try:
                os.replace(root, aside)
            except FileNotFoundError:
                aside = None  # someone else moved it; just retry
        try:
            os.replace(tmp, root)
        except OSError:  # another process put a dataset in place between our checks; re-examine it
            continue
        finally:
            if aside is not None:  # ignore_errors: a racing process may already have removed it
                shutil.rmtree(aside, ignore_errors=True)
        return
    shutil.rmtree(tmp, ignore_errors=True)
    raise RuntimeError(f"could not publish shapes dataset to {root}: it kept changing under us")


def generate_shapes(
    root: str | os.PathLike[str],
    spec: ShapesSpec = DEFAULT_SPEC,
    *,
    splits: Mapping[str, int] = DEFAULT_SPLITS,
    overwrite: bool = False,
) -> Path:
    """Write the shapes dataset as COCO under ``root``. If ``root`` already holds a complete dataset with the
    same parameters nothing is done; a ``root`` without the completion marker is regenerated.

    Args:
        root: the dataset folder.
        spec: what is drawn (:class:`ShapesSpec`).
        splits: how many images each split gets.
        overwrite: replace a complete dataset of other parameters instead of refusing it.

    Returns:
        ``root`` as a Path.

    Raises:
        FileExistsError: ``root`` holds a dataset with other parameters (and not ``overwrite``), or is not a
            directory.
    """
    params = _make_params(spec, splits)
    root, params_json = Path(root), params.to_json()
    if root.exists() and not overwrite:
        if not root.is_dir():
            raise FileExistsError(f"root {str(root)!r} exists and is not a directory")
        if (marker := _read_marker(root)) is not None:
            if marker.get("params") == params_json:
                return root
            raise FileExistsError(
                f"root {str(root)!r} holds a shapes dataset made with other parameters "
                f"({marker.get('params')}); pass overwrite=True to replace it"
            )
        if not all(child.name in {"images", "annotations", MARKER_NAME} for child in root.iterdir()):
            raise FileExistsError(
                f"root {str(root)!r} is a non-empty folder that is not a shapes dataset; "
                "refusing to replace it without overwrite=True"
            )
    root.parent.mkdir(parents=True, exist_ok=True)
    # Sibling of root so the final rename stays on one filesystem (and is atomic).
    tmp = root.with_name(f".{root.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.mkdir()
        summary = {name: _write_split(params, tmp, name, count) for name, count in params.splits}
        marker_text = json.dumps({"params": params_json, "splits": summary}, indent=2, sort_keys=True)
        (tmp / MARKER_NAME).write_text(marker_text + "\n", encoding="utf-8")
        _publish(tmp, root, params_json, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # left only if generating or publishing failed
    return root


def shapes_dataset_dir(
    cache_dir: str | os.PathLike[str],
    spec: ShapesSpec = DEFAULT_SPEC,
    *,
    splits: Mapping[str, int] = DEFAULT_SPLITS,
) -> Path:
    """``cache_dir / "shapes-<hash>"`` for these parameters (validated, not created). The hash covers every
    generation parameter and the format version, so changing any selects a fresh folder.
    """
    return Path(cache_dir) / f"shapes-{_make_params(spec, splits).short_hash()}"


def ensure_shapes(
    cache_dir: str | os.PathLike[str],
    spec: ShapesSpec = DEFAULT_SPEC,
    *,
    splits: Mapping[str, int] = DEFAULT_SPLITS,
) -> Path:
    """Return the dataset dir for these parameters, generating it only if incomplete (one small file read when
    it exists, so training calls it on every start).

    Args:
        cache_dir: where generated datasets live, one sub-folder per set of parameters.
        spec: what is drawn (:class:`ShapesSpec`).
        splits: images per split.

    Returns:
        The dataset folder, complete.
    """
    root = shapes_dataset_dir(cache_dir, spec, splits=splits)
    if _read_marker(root) is not None:
        return root
    # No marker: whatever is there is a leftover of ours and generate_shapes replaces it.
    return generate_shapes(root, spec, splits=splits)


def _parse_split(text: str) -> tuple[str, int]:
    """argparse type for ``NAME=COUNT``; the count's range is checked by generate_shapes."""
    name, sep, count = text.partition("=")
    if not sep or not count.strip().lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=COUNT, got {text!r}")
    return name.strip(), int(count)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m lit_amp_det.data.shapes OUTDIR [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m lit_amp_det.data.shapes",
        description="Generate the synthetic shapes dataset in COCO format.",
    )
    parser.add_argument("outdir", help="dataset folder (or cache folder with --cache)")
    parser.add_argument(
        "--split",
        action="append",
        type=_parse_split,
        metavar="NAME=COUNT",
        help="split and image count, repeatable (default train=800 val=100 test=100)",
    )
    parser.add_argument(
        "--image-size",
        type=int,
        nargs="+",
        default=[ShapesSpec.image_size],
        metavar="PX",
        help="side, or height width",
    )
    parser.add_argument("--min-objects", type=int, default=ShapesSpec.min_objects)
    parser.add_argument("--max-objects", type=int, default=ShapesSpec.max_objects)
    parser.add_argument("--min-size", type=float, default=ShapesSpec.min_size)
    parser.add_argument("--max-size", type=float, default=ShapesSpec.max_size)
    parser.add_argument("--empty-prob", type=float, default=ShapesSpec.empty_prob)
    parser.add_argument("--seed", type=int, default=ShapesSpec.seed)
    parser.add_argument(
        "--cache",
        action="store_true",
        help="treat OUTDIR as a cache folder and use a parameter-hashed subfolder",
    )
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    if len(args.image_size) not in (1, 2):
        parser.error("--image-size takes one or two integers")
    spec = ShapesSpec(
        image_size=args.image_size[0] if len(args.image_size) == 1 else tuple(args.image_size),
        min_objects=args.min_objects,
        max_objects=args.max_objects,
        min_size=args.min_size,
        max_size=args.max_size,
        seed=args.seed,
        empty_prob=args.empty_prob,
    )
    splits = dict(args.split) if args.split else DEFAULT_SPLITS
    start = time.perf_counter()
    try:
        root = (
            ensure_shapes(args.outdir, spec, splits=splits)
            if args.cache
            else generate_shapes(args.outdir, spec, splits=splits, overwrite=args.overwrite)
        )
    except (ValueError, FileExistsError) as err:
        parser.error(str(err))
    marker = _read_marker(root) or {}
    print(f"{root} ({time.perf_counter() - start:.1f}s): {json.dumps(marker.get('splits', {}))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Deterministic synthetic "shapes" instance-segmentation dataset written as real COCO.

This module renders small RGB images of coloured geometric shapes (circle, square,
triangle, star, ring, cross) on textured backgrounds and writes them to disk in the
exact layout of a COCO detection dataset (``images/<split>/*.png`` plus
``annotations/instances_<split>.json``). It exists so that the default training path
(and the test-suite) exercises the very same COCO loader, mask decoding and evaluation
code as the real dataset, without a download: shapes are occluded by one another, only
their visible region is labelled, and both polygon and compressed-RLE segmentations
occur, as in COCO. Every image is drawn from its own ``numpy`` PCG64 stream keyed by
(seed, split, index), so the output is byte-identical across runs and independent per
split, and the dataset is published with an atomic rename plus a completion marker so
an interrupted or concurrent generation never leaves a dataset that only looks complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
from PIL import Image
from pycocotools import mask as mask_utils

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
]

SHAPE_CLASSES: tuple[str, ...] = ("circle", "square", "triangle", "star", "ring", "cross")
"""Category names; category id ``i + 1`` is ``SHAPE_CLASSES[i]``."""

DEFAULT_SPLITS: Mapping[str, int] = MappingProxyType({"train": 800, "val": 100, "test": 100})
"""Images per split used when ``splits`` is not given (read-only)."""

MARKER_NAME = "DONE"
"""File written last into a dataset dir; its presence means the dataset is complete."""

# Bump whenever rendering changes, so cached datasets from older code are not reused.
FORMAT_VERSION = 2

# Instances hidden below these limits are still drawn but not labelled, as a human
# annotator would not label a shape they cannot recognise.
MIN_VISIBLE_FRACTION = 0.3
MIN_VISIBLE_PIXELS = 20

DEFAULT_EMPTY_PROB = 0.02
MIN_IMAGE_SIDE = 32
CIRCLE_VERTICES = 32
_SPLIT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_PNG_COMPRESS_LEVEL = 1  # ~2x faster than the default, files barely larger (noise dominates)


# --------------------------------------------------------------------------- params


@dataclass(frozen=True)
class _Params:
    """Validated, normalised generation parameters (what the cache hash is taken of)."""

    splits: tuple[tuple[str, int], ...]
    height: int
    width: int
    min_objects: int
    max_objects: int
    min_size: float
    max_size: float
    seed: int
    empty_prob: float

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form; stable key order so hashes and markers are reproducible."""
        return {
            "format_version": FORMAT_VERSION,
            "splits": dict(self.splits),
            "image_size": [self.height, self.width],
            "min_objects": self.min_objects,
            "max_objects": self.max_objects,
            "min_size": self.min_size,
            "max_size": self.max_size,
            "seed": self.seed,
            "empty_prob": self.empty_prob,
        }

    def short_hash(self) -> str:
        """12 hex chars identifying these parameters, used to name cache folders."""
        blob = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:12]


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `splits={"train": True}` is surely a mistake.
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def _check_image_size(image_size: int | Sequence[int]) -> tuple[int, int]:
    """Return (height, width) from an int or a (height, width) pair."""
    if _is_int(image_size):
        size = (int(image_size), int(image_size))  # type: ignore[arg-type]
    elif (
        isinstance(image_size, Sequence)
        and not isinstance(image_size, str)
        and len(image_size) == 2
        and all(_is_int(v) for v in image_size)
    ):
        size = (int(image_size[0]), int(image_size[1]))
    else:
        raise ValueError(
            f"image_size must be an int or a (height, width) pair of ints, got {image_size!r}"
        )
    if min(size) < MIN_IMAGE_SIDE:
        raise ValueError(f"image_size must be >= {MIN_IMAGE_SIDE} on each side, got {image_size!r}")
    return size


def _check_splits(splits: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """Validate split names (used as folder/file names) and their image counts."""
    if not isinstance(splits, Mapping) or len(splits) == 0:
        raise ValueError(f"splits must be a non-empty mapping of split name to image count, got {splits!r}")
    for name, count in splits.items():
        if not isinstance(name, str) or not _SPLIT_NAME_RE.match(name):
            raise ValueError(
                f"splits key {name!r} must be a simple name (letters, digits, '_', '-', '.')"
            )
        if not _is_int(count):
            raise ValueError(f"splits[{name!r}] must be an int, got {count!r}")
        if count < 1:
            raise ValueError(f"splits[{name!r}] must be >= 1, got {count}")
    return tuple(sorted((name, int(count)) for name, count in splits.items()))


def _make_params(
    *,
    splits: Mapping[str, int],
    image_size: int | Sequence[int],
    min_objects: int,
    max_objects: int,
    min_size: float,
    max_size: float,
    seed: int,
    empty_prob: float,
) -> _Params:
    """Validate every generation argument, raising ValueError naming the bad one."""
    split_items = _check_splits(splits)
    height, width = _check_image_size(image_size)
    if not _is_int(min_objects) or min_objects < 0:
        raise ValueError(f"min_objects must be an int >= 0, got {min_objects!r}")
    if not _is_int(max_objects) or max_objects < 1:
        raise ValueError(f"max_objects must be an int >= 1, got {max_objects!r}")
    if min_objects > max_objects:
        raise ValueError(
            f"min_objects must be <= max_objects, got min_objects={min_objects}, max_objects={max_objects}"
        )
    for name, value in (("min_size", min_size), ("max_size", max_size)):
        if not _is_real(value) or not (0.0 < float(value) <= 1.0) or math.isnan(float(value)):
            raise ValueError(f"{name} must be a fraction of the image side in (0, 1], got {value!r}")
    if min_size > max_size:
        raise ValueError(f"min_size must be <= max_size, got min_size={min_size}, max_size={max_size}")
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if not _is_real(empty_prob) or not (0.0 <= float(empty_prob) <= 1.0):
        raise ValueError(f"empty_prob must be in [0, 1], got {empty_prob!r}")
    return _Params(
        splits=split_items,
        height=height,
        width=width,
        min_objects=int(min_objects),
        max_objects=int(max_objects),
        min_size=float(min_size),
        max_size=float(max_size),
        seed=int(seed),
        empty_prob=float(empty_prob),
    )


# --------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class ShapeInstance:
    """One drawn shape: its class, geometry and masks (bool HxW arrays).

    ``full_mask`` is the shape clipped to the image but ignoring occlusion;
    ``visible_mask`` is what remains after later shapes were drawn over it. Instances
    with ``labelled=False`` were drawn but are too hidden to be annotated.
    """

    category_id: int
    colour: tuple[int, int, int]
    vertices: tuple[float, ...]
    hole_vertices: tuple[float, ...] | None
    full_mask: np.ndarray
    visible_mask: np.ndarray
    labelled: bool

    @property
    def name(self) -> str:
        """Class name of the shape."""
        return SHAPE_CLASSES[self.category_id - 1]


@dataclass(frozen=True)
class RenderedImage:
    """An RGB uint8 HxWx3 image and every shape drawn into it, in drawing order."""

    image: np.ndarray
    instances: tuple[ShapeInstance, ...]


def _split_key(split: str) -> int:
    """Stable 64-bit integer for a split name (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(split.encode("utf-8")).digest()[:8], "little")


def _image_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """Independent stream per image, so splits and images can be drawn in any order."""
    seq = np.random.SeedSequence([FORMAT_VERSION, seed, _split_key(split), index])
    return np.random.Generator(np.random.PCG64(seq))


def _unit_direction(rng: np.random.Generator) -> tuple[float, float]:
    """Random direction from a small integer vector.

    Normalising by sqrt (correctly rounded by IEEE 754) instead of cos/sin of a random
    angle keeps background pixels bit-identical across libm implementations.
    """
    while True:
        a, b = (int(v) for v in rng.integers(-4, 5, size=2))
        if a or b:
            norm = math.sqrt(a * a + b * b)
            return a / norm, b / norm


def _upsample_bilinear(grid: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinearly stretch a coarse (gh, gw, C) grid to (height, width, C) with numpy."""
    gh, gw = grid.shape[:2]
    ys = np.arange(height, dtype=np.float64) * ((gh - 1) / (height - 1))
    xs = np.arange(width, dtype=np.float64) * ((gw - 1) / (width - 1))
    y0 = np.minimum(ys.astype(np.int64), gh - 2)
    x0 = np.minimum(xs.astype(np.int64), gw - 2)
    fy = (ys - y0)[:, None, None]
    fx = (xs - x0)[None, :, None]
    rows = grid[y0] * (1.0 - fy) + grid[y0 + 1] * fy
    return rows[:, x0] * (1.0 - fx) + rows[:, x0 + 1] * fx


def _pattern(rng: np.random.Generator, yy: np.ndarray, xx: np.ndarray) -> np.ndarray:
    """A random two-colour pattern (stripes, checker or gradient), shape (H, W, 3)."""
    dx, dy = _unit_direction(rng)
    along = xx * dx + yy * dy
    kind = int(rng.integers(0, 4))
    if kind == 0:  # soft stripes (triangle wave avoids sin for cross-platform bit-exactness)
        period = 6.0 + 18.0 * rng.random()
        u = along / period + rng.random()
        t = np.abs(2.0 * (u - np.floor(u)) - 1.0)
    elif kind == 1:  # hard stripes
        period = 5.0 + 15.0 * rng.random()
        u = along / period + rng.random()
        t = ((u - np.floor(u)) < 0.5).astype(np.float64)
    elif kind == 2:  # rotated checkerboard
        cell = 5.0 + 15.0 * rng.random()
        across = -xx * dy + yy * dx
        t = np.mod(np.floor(along / cell) + np.floor(across / cell), 2.0)
    else:  # linear gradient across the image
        t = along - along.min()
        t = t / max(float(t.max()), 1e-9)
    # the two pattern colours stay within +-60 of each other: a textured but not shape-like background
    c1 = rng.random(3) * 255.0
    c2 = np.clip(c1 + (rng.random(3) * 2.0 - 1.0) * 60.0, 0.0, 255.0)
    return c1 * (1.0 - t[..., None]) + c2 * t[..., None]


def _background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Textured float background: low-frequency colour noise blended with a pattern."""
    gh, gw = (int(v) for v in rng.integers(2, 7, size=2))
    lowfreq = _upsample_bilinear(rng.random((gh, gw, 3)) * 255.0, height, width)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    pattern = _pattern(rng, yy, xx)
    alpha = 0.25 + 0.5 * rng.random()
    return alpha * lowfreq + (1.0 - alpha) * pattern


def _regular_polygon(n: int, radius: float, phase: float) -> np.ndarray:
    """(n, 2) vertices of a regular n-gon centred on the origin."""
    angles = [phase + 2.0 * math.pi * k / n for k in range(n)]
    return np.array([[radius * math.cos(a), radius * math.sin(a)] for a in angles])


def _rotate(points: np.ndarray, angle: float) -> np.ndarray:
    """Rotate (n, 2) points about the origin."""
    c, s = math.cos(angle), math.sin(angle)
    return points @ np.array([[c, s], [-s, c]])


def _shape_outline(
    name: str, radius: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray | None]:
    """Local (origin-centred) outline of a shape fitting a circle of ``radius``, and
    the outline of its hole (rings only)."""
    angle = 2.0 * math.pi * rng.random()
    if name == "circle":
        return _regular_polygon(CIRCLE_VERTICES, radius, angle), None
    if name == "square":
        return _regular_polygon(4, radius, angle), None
    if name == "triangle":
        return _regular_polygon(3, radius, angle), None
    if name == "star":
        outer = _regular_polygon(10, radius, angle)
        inner_ratio = 0.38 + 0.14 * rng.random()
        outer[1::2] *= inner_ratio  # every other vertex pulled in makes a 5-point star
        return outer, None
    if name == "ring":
        inner_ratio = 0.45 + 0.2 * rng.random()
        return (
            _regular_polygon(CIRCLE_VERTICES, radius, angle),
            _regular_polygon(CIRCLE_VERTICES, radius * inner_ratio, angle),
        )
    if name == "cross":
        arm = radius * (0.2 + 0.1 * rng.random())
        r = radius
        plus = np.array(
            [
                [arm, -r], [arm, -arm], [r, -arm], [r, arm], [arm, arm], [arm, r],
                [-arm, r], [-arm, arm], [-r, arm], [-r, -arm], [-arm, -arm], [-arm, -r],
            ]
        )
        return _rotate(plus, angle), None
    raise ValueError(f"unknown shape name {name!r}")


def _flat(points: np.ndarray) -> tuple[float, ...]:
    """Round to 1/100 px and flatten to COCO's [x1, y1, x2, y2, ...].

    Rounding before both rasterising and writing makes the JSON exactly describe the
    drawn shape and hides last-bit differences between libm implementations.
    """
    return tuple(round(float(v), 2) for v in points.reshape(-1))


def _rasterise(flat: Sequence[float], height: int, width: int) -> np.ndarray:
    """Bool mask of a polygon via pycocotools, without antialiasing.

    The COCO rasteriser is used (not PIL) so a written polygon decodes with
    ``annToMask`` to exactly the pixels painted into the image; PIL's fill convention
    differs by about half a pixel, a large error for 20 px shapes.
    """
    rles = mask_utils.frPyObjects([list(flat)], height, width)
    return mask_utils.decode(rles)[:, :, 0].astype(bool)


def _shape_colour(rng: np.random.Generator, canvas: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Random RGB colour (class-independent) with some contrast to what lies beneath."""
    colour = np.floor(rng.random(3) * 256.0)
    if mask.any():
        under = canvas[mask].mean(axis=0)
        if float(np.sqrt(np.sum((colour - under) ** 2))) < 80.0:
            colour = np.mod(colour + 128.0, 256.0)
    return colour


def _paint(rng: np.random.Generator, canvas: np.ndarray, mask: np.ndarray,
           colour: np.ndarray, cx: float, cy: float, radius: float) -> None:
    """Fill ``mask`` with ``colour`` plus a linear shading, like a lit flat object."""
    ys, xs = np.nonzero(mask)
    dx, dy = _unit_direction(rng)
    strength = 40.0 * rng.random()
    shade = ((xs - cx) * dx + (ys - cy) * dy) * (strength / radius)
    canvas[ys, xs] = colour[None, :] + shade[:, None]


def render_shapes_image(
    seed: int,
    split: str,
    index: int,
    *,
    image_size: int | tuple[int, int] = 160,
    min_objects: int = 1,
    max_objects: int = 6,
    min_size: float = 0.12,
    max_size: float = 0.45,
    empty_prob: float = DEFAULT_EMPTY_PROB,
) -> RenderedImage:
    """Render image ``index`` of ``split`` exactly as :func:`generate_shapes` writes it.

    Exposed so callers and tests can inspect full (unoccluded) and visible masks,
    which the COCO files do not carry. ``image_size`` is an int or (height, width).
    """
    if not _is_int(index) or index < 0:
        raise ValueError(f"index must be an int >= 0, got {index!r}")
    params = _make_params(
        splits={split: index + 1}, image_size=image_size, min_objects=min_objects,
        max_objects=max_objects, min_size=min_size, max_size=max_size, seed=seed,
        empty_prob=empty_prob,
    )
    return _render(params, split, index)


def _render(params: _Params, split: str, index: int) -> RenderedImage:
    """Draw background then shapes in order; later shapes occlude earlier ones."""
    rng = _image_rng(params.seed, split, index)
    height, width = params.height, params.width
    canvas = _background(rng, height, width)
    if rng.random() < params.empty_prob:
        n_objects = 0
    else:
        n_objects = int(rng.integers(params.min_objects, params.max_objects + 1))
    # owner[y, x] = 1 + index of the topmost shape covering the pixel (0 = background)
    owner = np.zeros((height, width), dtype=np.int32)
    drawn: list[tuple[int, np.ndarray, tuple[float, ...], tuple[float, ...] | None, np.ndarray]] = []
    side = min(height, width)
    for k in range(n_objects):
        category = int(rng.integers(0, len(SHAPE_CLASSES)))
        diameter = (params.min_size + (params.max_size - params.min_size) * rng.random()) * side
        radius = diameter / 2.0
        # centre inside the image: shapes may hang over the border but stay recognisable
        centre = np.array([rng.random() * width, rng.random() * height])
        outline, hole = _shape_outline(SHAPE_CLASSES[category], radius, rng)
        vertices = _flat(outline + centre)
        mask = _rasterise(vertices, height, width)
        hole_vertices = None
        if hole is not None:
            hole_vertices = _flat(hole + centre)
            mask &= ~_rasterise(hole_vertices, height, width)
        colour = _shape_colour(rng, canvas, mask)
        _paint(rng, canvas, mask, colour, float(centre[0]), float(centre[1]), radius)
        owner[mask] = k + 1
        drawn.append((category + 1, mask, vertices, hole_vertices, colour))
    noise_amp = int(rng.integers(2, 7))
    noise = rng.integers(-noise_amp, noise_amp + 1, size=(height, width, 3))
    image = np.clip(np.rint(canvas + noise), 0, 255).astype(np.uint8)
    instances = []
    for k, (category_id, mask, vertices, hole_vertices, colour) in enumerate(drawn):
        visible = owner == k + 1
        full_area = int(mask.sum())
        visible_area = int(visible.sum())
        labelled = (
            visible_area >= MIN_VISIBLE_PIXELS and visible_area >= MIN_VISIBLE_FRACTION * full_area
        )
        instances.append(
            ShapeInstance(
                category_id=category_id,
                colour=(int(colour[0]), int(colour[1]), int(colour[2])),
                vertices=vertices,
                hole_vertices=hole_vertices,
                full_mask=mask,
                visible_mask=visible,
                labelled=labelled,
            )
        )
    return RenderedImage(image=image, instances=tuple(instances))


# --------------------------------------------------------------------------- annotation


def _clip_polygon(flat: Sequence[float], width: int, height: int) -> list[tuple[float, float]]:
    """Sutherland-Hodgman clip of a polygon to the image rectangle [0, W] x [0, H].

    Correct for our shapes because each is star-shaped about a centre inside the image,
    so the clipped region stays one piece.
    """
    points = [(float(flat[i]), float(flat[i + 1])) for i in range(0, len(flat), 2)]
    for axis, bound, keep_above in ((0, 0.0, True), (0, float(width), False),
                                    (1, 0.0, True), (1, float(height), False)):
        if not points:
            break

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
        points = clipped
    return points


def _polygon_segmentation(inst: ShapeInstance, height: int, width: int) -> list[list[float]] | None:
    """COCO polygon for a fully visible, hole-free instance, or None if RLE is needed.

    The clipped polygon is re-rasterised and only used if it reproduces the visible mask
    pixel for pixel, so polygon and RLE annotations are equally exact.
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


def _rle_segmentation(mask: np.ndarray) -> dict[str, Any]:
    """Compressed COCO RLE with ``counts`` as str, so it can go into JSON."""
    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    return {"size": [int(rle["size"][0]), int(rle["size"][1])], "counts": rle["counts"].decode("ascii")}


def _tight_bbox(mask: np.ndarray) -> list[float]:
    """[x, y, w, h] of the smallest pixel box containing the mask."""
    rows = np.flatnonzero(mask.any(axis=1))
    cols = np.flatnonzero(mask.any(axis=0))
    x0, x1, y0, y1 = int(cols[0]), int(cols[-1]), int(rows[0]), int(rows[-1])
    return [float(x0), float(y0), float(x1 - x0 + 1), float(y1 - y0 + 1)]


def _annotation(inst: ShapeInstance, ann_id: int, image_id: int, height: int, width: int) -> dict[str, Any]:
    """COCO annotation dict for the visible part of one labelled instance."""
    segmentation: Any = _polygon_segmentation(inst, height, width)
    if segmentation is None:
        segmentation = _rle_segmentation(inst.visible_mask)
    return {
        "id": ann_id,
        "image_id": image_id,
        "category_id": inst.category_id,
        "segmentation": segmentation,
        "area": float(inst.visible_mask.sum()),
        "bbox": _tight_bbox(inst.visible_mask),
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
        images.append({"id": image_id, "file_name": file_name, "width": params.width, "height": params.height})
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


# --------------------------------------------------------------------------- on disk


def _read_marker(root: Path) -> dict[str, Any] | None:
    """The marker's content, or None if the dataset is absent or incomplete."""
    try:
        content = json.loads((root / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def _looks_like_ours(root: Path) -> bool:
    """True if ``root`` holds nothing but what a (partial) shapes dataset would.

    Guards against deleting a user's unrelated folder passed as ``root`` by mistake.
    """
    return all(child.name in {"images", "annotations", MARKER_NAME} for child in root.iterdir())


def _remove_tree(path: Path) -> None:
    """Best-effort delete: a racing process may already have removed or moved it."""
    shutil.rmtree(path, ignore_errors=True)


def _publish(tmp: Path, root: Path, params_json: dict[str, Any], overwrite: bool) -> None:
    """Atomically move the finished ``tmp`` dataset to ``root``.

    An existing ``root`` is first renamed aside (rename is atomic, rmtree is not), so at
    every instant ``root`` is either absent, the old dataset, or the complete new one.
    Losing a race to another process that published the same parameters is success.
    """
    for _attempt in range(3):
        marker = _read_marker(root) if root.exists() else None
        if marker is not None and not overwrite:
            if marker.get("params") == params_json:
                _remove_tree(tmp)  # generation is deterministic: theirs equals ours
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
        except OSError:
            # Another process put a dataset in place between our checks; re-examine it.
            if aside is not None:
                _remove_tree(aside)
            continue
        if aside is not None:
            _remove_tree(aside)
        return
    _remove_tree(tmp)
    raise RuntimeError(f"could not publish shapes dataset to {root}: it kept changing under us")


def generate_shapes(
    root: str | os.PathLike[str],
    *,
    splits: Mapping[str, int] = DEFAULT_SPLITS,
    image_size: int | tuple[int, int] = 160,
    min_objects: int = 1,
    max_objects: int = 6,
    min_size: float = 0.12,
    max_size: float = 0.45,
    seed: int = 0,
    empty_prob: float = DEFAULT_EMPTY_PROB,
    overwrite: bool = False,
) -> Path:
    """Write the shapes dataset as COCO under ``root`` and return ``root`` as a Path.

    ``image_size`` is an int or (height, width); shape diameters are drawn uniformly in
    ``[min_size, max_size] * min(height, width)``; each image holds
    ``min_objects..max_objects`` shapes, except that a fraction ``empty_prob`` of images
    holds none (as in real COCO). If ``root`` already holds a complete dataset with the
    same parameters nothing is done; a complete one with other parameters raises
    FileExistsError unless ``overwrite``. A ``root`` without the completion marker (an
    interrupted write by older code, or a deleted marker) is regenerated.
    """
    params = _make_params(
        splits=splits, image_size=image_size, min_objects=min_objects, max_objects=max_objects,
        min_size=min_size, max_size=max_size, seed=seed, empty_prob=empty_prob,
    )
    root = Path(root)
    params_json = params.to_json()
    if root.exists() and not overwrite:
        if not root.is_dir():
            raise FileExistsError(f"root {str(root)!r} exists and is not a directory")
        marker = _read_marker(root)
        if marker is not None:
            if marker.get("params") == params_json:
                return root
            raise FileExistsError(
                f"root {str(root)!r} holds a shapes dataset made with other parameters "
                f"({marker.get('params')}); pass overwrite=True to replace it"
            )
        if not _looks_like_ours(root):
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
        if tmp.exists():
            _remove_tree(tmp)
    return root


def shapes_dataset_dir(
    cache_dir: str | os.PathLike[str],
    *,
    splits: Mapping[str, int] = DEFAULT_SPLITS,
    image_size: int | tuple[int, int] = 160,
    min_objects: int = 1,
    max_objects: int = 6,
    min_size: float = 0.12,
    max_size: float = 0.45,
    seed: int = 0,
    empty_prob: float = DEFAULT_EMPTY_PROB,
) -> Path:
    """``cache_dir / "shapes-<hash>"`` for these parameters (validated, not created).

    The hash covers every generation parameter and the format version, so changing any
    of them selects a fresh folder instead of silently reusing stale data.
    """
    params = _make_params(
        splits=splits, image_size=image_size, min_objects=min_objects, max_objects=max_objects,
        min_size=min_size, max_size=max_size, seed=seed, empty_prob=empty_prob,
    )
    return Path(cache_dir) / f"shapes-{params.short_hash()}"


def ensure_shapes(
    cache_dir: str | os.PathLike[str],
    *,
    splits: Mapping[str, int] = DEFAULT_SPLITS,
    image_size: int | tuple[int, int] = 160,
    min_objects: int = 1,
    max_objects: int = 6,
    min_size: float = 0.12,
    max_size: float = 0.45,
    seed: int = 0,
    empty_prob: float = DEFAULT_EMPTY_PROB,
) -> Path:
    """Return the dataset dir for these parameters, generating it only if incomplete.

    Cheap when the dataset exists (one small file read), so training can call it on
    every start.
    """
    kwargs: dict[str, Any] = dict(
        splits=splits, image_size=image_size, min_objects=min_objects, max_objects=max_objects,
        min_size=min_size, max_size=max_size, seed=seed, empty_prob=empty_prob,
    )
    root = shapes_dataset_dir(cache_dir, **kwargs)
    if _read_marker(root) is not None:
        return root
    # No marker: whatever is there is a leftover of ours and generate_shapes replaces it.
    return generate_shapes(root, **kwargs)


# --------------------------------------------------------------------------- CLI


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
    parser.add_argument("--split", action="append", type=_parse_split, metavar="NAME=COUNT",
                        help="split and image count, repeatable (default train=800 val=100 test=100)")
    parser.add_argument("--image-size", type=int, nargs="+", default=[160], metavar="PX",
                        help="side, or height width")
    parser.add_argument("--min-objects", type=int, default=1)
    parser.add_argument("--max-objects", type=int, default=6)
    parser.add_argument("--min-size", type=float, default=0.12)
    parser.add_argument("--max-size", type=float, default=0.45)
    parser.add_argument("--empty-prob", type=float, default=DEFAULT_EMPTY_PROB)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", action="store_true",
                        help="treat OUTDIR as a cache folder and use a parameter-hashed subfolder")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    if len(args.image_size) not in (1, 2):
        parser.error("--image-size takes one or two integers")
    kwargs: dict[str, Any] = dict(
        splits=dict(args.split) if args.split else DEFAULT_SPLITS,
        image_size=args.image_size[0] if len(args.image_size) == 1 else tuple(args.image_size),
        min_objects=args.min_objects, max_objects=args.max_objects, min_size=args.min_size,
        max_size=args.max_size, seed=args.seed, empty_prob=args.empty_prob,
    )
    start = time.perf_counter()
    try:
        if args.cache:
            root = ensure_shapes(args.outdir, **kwargs)
        else:
            root = generate_shapes(args.outdir, overwrite=args.overwrite, **kwargs)
    except (ValueError, FileExistsError) as err:
        parser.error(str(err))
    marker = _read_marker(root) or {}
    print(f"{root} ({time.perf_counter() - start:.1f}s): {json.dumps(marker.get('splits', {}))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

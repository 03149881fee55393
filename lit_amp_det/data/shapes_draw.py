"""Drawing one image of the synthetic shapes dataset: textured background, occluding shapes, their masks.

Every image is drawn from its own ``numpy`` PCG64 stream keyed by (seed, split, index), so the output is
byte-identical across runs and independent per split; :mod:`lit_amp_det.data.shapes` writes the images and
their COCO annotations.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from pycocotools import mask as mask_utils

from lit_amp_det.data.shapes_spec import (
    CIRCLE_VERTICES,
    DEFAULT_SPEC,
    FORMAT_VERSION,
    MIN_VISIBLE_FRACTION,
    MIN_VISIBLE_PIXELS,
    SHAPE_CLASSES,
    ShapesSpec,
    _is_int,
    _make_params,
    _Params,
)

__all__ = ["RenderedImage", "ShapeInstance", "render_shapes_image"]

#: Vertices of the shapes that are plain regular polygons.
_POLYGON_SIDES = {"circle": CIRCLE_VERTICES, "square": 4, "triangle": 3}


@dataclass(frozen=True)
class ShapeInstance:
    """One drawn shape: its class, geometry and masks (bool HxW arrays). ``full_mask`` is the shape clipped to
    the image but ignoring occlusion; ``visible_mask`` is what remains after later shapes were drawn over it.
    Instances with ``labelled=False`` were drawn but are too hidden to be annotated.
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


def _unit_direction(rng: np.random.Generator) -> tuple[float, float]:
    """Random direction from a small integer vector. Normalising by sqrt (correctly rounded by IEEE 754)
    instead of cos/sin of a random angle keeps background pixels bit-identical across libm implementations.
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
    y0, x0 = np.minimum(ys.astype(np.int64), gh - 2), np.minimum(xs.astype(np.int64), gw - 2)
    fy, fx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
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


def _shape_outline(
    name: str, radius: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray | None]:
    """Local (origin-centred) outline of a shape fitting a circle of ``radius``, and that of its hole (rings
    only).
    """
    angle = 2.0 * math.pi * rng.random()
    if name in _POLYGON_SIDES:
        return _regular_polygon(_POLYGON_SIDES[name], radius, angle), None
    if name == "star":
        outer = _regular_polygon(10, radius, angle)
        outer[1::2] *= 0.38 + 0.14 * rng.random()  # every other vertex pulled in makes a 5-point star
        return outer, None
    if name == "ring":
        inner_ratio = 0.45 + 0.2 * rng.random()
        return (
            _regular_polygon(CIRCLE_VERTICES, radius, angle),
            _regular_polygon(CIRCLE_VERTICES, radius * inner_ratio, angle),
        )
    if name == "cross":
        arm, r = radius * (0.2 + 0.1 * rng.random()), radius
        plus = np.array(
            [
                [arm, -r],
                [arm, -arm],
                [r, -arm],
                [r, arm],
                [arm, arm],
                [arm, r],
                [-arm, r],
                [-arm, arm],
                [-r, arm],
                [-r, -arm],
                [-arm, -arm],
                [-arm, -r],
            ]
        )
        c, s = math.cos(angle), math.sin(angle)
        return plus @ np.array([[c, s], [-s, c]]), None  # rotated about the origin
    raise ValueError(f"unknown shape name {name!r}")


def _flat(points: np.ndarray) -> tuple[float, ...]:
    """Round to 1/100 px and flatten to COCO's [x1, y1, x2, y2, ...]. Rounding before both rasterising and
    writing makes the JSON exactly describe the drawn shape and hides last-bit differences between libm
    implementations.
    """
    return tuple(round(float(v), 2) for v in points.reshape(-1))


def _rasterise(flat: Sequence[float], height: int, width: int) -> np.ndarray:
    """Bool mask of a polygon via pycocotools, without antialiasing. The COCO rasteriser is used (not PIL) so
    a written polygon decodes with ``annToMask`` to exactly the pixels painted into the image; PIL's fill
    convention differs by about half a pixel, a large error for 20 px shapes.
    """
    return mask_utils.decode(mask_utils.frPyObjects([list(flat)], height, width))[:, :, 0].astype(bool)


def _shape_colour(rng: np.random.Generator, canvas: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Random RGB colour (class-independent) with some contrast to what lies beneath."""
    colour = np.floor(rng.random(3) * 256.0)
    if mask.any() and float(np.sqrt(np.sum((colour - canvas[mask].mean(axis=0)) ** 2))) < 80.0:
        colour = np.mod(colour + 128.0, 256.0)
    return colour


def render_shapes_image(split: str, index: int, spec: ShapesSpec = DEFAULT_SPEC) -> RenderedImage:
    """Render image ``index`` of ``split`` exactly as :func:`generate_shapes` writes it for ``spec``. Exposed
    so callers and tests can inspect full (unoccluded) and visible masks, which the COCO files do not carry.
    """
    if not _is_int(index) or index < 0:
        raise ValueError(f"index must be an int >= 0, got {index!r}")
    return _render(_make_params(spec, {split: index + 1}), split, index)


def _render(params: _Params, split: str, index: int) -> RenderedImage:
    """Draw background then shapes in order; later shapes occlude earlier ones."""
    # an independent stream per image, so splits and images can be drawn in any order
    split_key = int.from_bytes(
        hashlib.sha256(split.encode("utf-8")).digest()[:8], "little"
    )  # hash() is salted
    rng = np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([FORMAT_VERSION, params.seed, split_key, index]))
    )
    height, width = params.height, params.width
    canvas = _background(rng, height, width)
    n_objects = (
        0
        if rng.random() < params.empty_prob
        else int(rng.integers(params.min_objects, params.max_objects + 1))
    )
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
        hole_vertices = None if hole is None else _flat(hole + centre)
        if hole_vertices is not None:
            mask &= ~_rasterise(hole_vertices, height, width)
        colour = _shape_colour(rng, canvas, mask)
        ys, xs = np.nonzero(mask)  # paint: the colour plus a linear shading, like a lit flat object
        dx, dy = _unit_direction(rng)
        strength = 40.0 * rng.random()
        shade = ((xs - float(centre[0])) * dx + (ys - float(centre[1])) * dy) * (strength / radius)
        canvas[ys, xs] = colour[None, :] + shade[:, None]
        owner[mask] = k + 1
        drawn.append((category + 1, mask, vertices, hole_vertices, colour))
    noise_amp = int(rng.integers(2, 7))
    noise = rng.integers(-noise_amp, noise_amp + 1, size=(height, width, 3))
    image = np.clip(np.rint(canvas + noise), 0, 255).astype(np.uint8)
    instances = []
    for k, (category_id, mask, vertices, hole_vertices, colour) in enumerate(drawn):
        visible = owner == k + 1
        visible_area = int(visible.sum())
        labelled = visible_area >= MIN_VISIBLE_PIXELS and visible_area >= MIN_VISIBLE_FRACTION * int(
            mask.sum()
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

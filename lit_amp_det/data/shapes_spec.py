"""What the synthetic shapes dataset is made of: the generator's parameters, their defaults and checks.

:class:`ShapesSpec` holds every drawing parameter with the defaults of the embedded dataset; the code
(:mod:`lit_amp_det.data.shapes`, :class:`lit_amp_det.data.ShapesDataModule`) takes its defaults from it and
``conf/data/shapes.yaml`` repeats them for the command line (a test keeps the two equal).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

__all__ = ["DEFAULT_SPEC", "DEFAULT_SPLITS", "SHAPE_CLASSES", "ShapesSpec"]

SHAPE_CLASSES: tuple[str, ...] = ("circle", "square", "triangle", "star", "ring", "cross")
"""Category names; category id ``i + 1`` is ``SHAPE_CLASSES[i]``."""

DEFAULT_SPLITS: Mapping[str, int] = MappingProxyType({"train": 800, "val": 100, "test": 100})
"""Images per split used when ``splits`` is not given (read-only)."""

# Bump whenever rendering changes, so cached datasets from older code are not reused.
FORMAT_VERSION = 2

# Instances hidden below these limits are still drawn but not labelled, as an annotator could not recognise
# them.
MIN_VISIBLE_FRACTION = 0.3
MIN_VISIBLE_PIXELS = 20

DEFAULT_EMPTY_PROB = 0.02
MIN_IMAGE_SIDE = 32
CIRCLE_VERTICES = 32
_SPLIT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class ShapesSpec:
    """The generator's drawing parameters, defaults included (one home for them).

    Args:
        image_size: side of the square images, or (height, width), in pixels.
        min_objects, max_objects: shapes per image (``max_objects`` inclusive).
        min_size, max_size: shape diameter as a fraction of the shorter image side.
        empty_prob: fraction of images drawn with no shape at all (as in real COCO).
        seed: seed of the content (each image has its own stream keyed by seed, split and index).
    """

    image_size: int | tuple[int, int] = 160
    min_objects: int = 1
    max_objects: int = 5
    min_size: float = 0.15
    max_size: float = 0.45
    empty_prob: float = DEFAULT_EMPTY_PROB
    seed: int = 0


#: The spec a function that takes one uses when it is not given (immutable, so one instance serves all).
DEFAULT_SPEC = ShapesSpec()


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


def _is_int(
    value: object,
) -> bool:  # bool is an int subclass, but `splits={"train": True}` is surely a mistake.
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
        raise ValueError(f"image_size must be an int or a (height, width) pair of ints, got {image_size!r}")
    if min(size) < MIN_IMAGE_SIDE:
        raise ValueError(f"image_size must be >= {MIN_IMAGE_SIDE} on each side, got {image_size!r}")
    return size


def _check_splits(splits: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """Validate split names (used as folder/file names) and their image counts."""
    if not isinstance(splits, Mapping) or len(splits) == 0:
        raise ValueError(f"splits must be a non-empty mapping of split name to image count, got {splits!r}")
    for name, count in splits.items():
        if not isinstance(name, str) or not _SPLIT_NAME_RE.match(name):
            raise ValueError(f"splits key {name!r} must be a simple name (letters, digits, '_', '-', '.')")
        if not _is_int(count):
            raise ValueError(f"splits[{name!r}] must be an int, got {count!r}")
        if count < 1:
            raise ValueError(f"splits[{name!r}] must be >= 1, got {count}")
    return tuple(sorted((name, int(count)) for name, count in splits.items()))


def _make_params(spec: ShapesSpec, splits: Mapping[str, int]) -> _Params:
    """Validate ``spec`` and ``splits``, raising ValueError naming the bad field."""
    image_size, min_objects, max_objects = spec.image_size, spec.min_objects, spec.max_objects
    min_size, max_size, seed, empty_prob = spec.min_size, spec.max_size, spec.seed, spec.empty_prob
    split_items, (height, width) = _check_splits(splits), _check_image_size(image_size)
    if not _is_int(min_objects) or min_objects < 0:
        raise ValueError(f"min_objects must be an int >= 0, got {min_objects!r}")
    if not _is_int(max_objects) or max_objects < 1:
        raise ValueError(f"max_objects must be an int >= 1, got {max_objects!r}")
    if min_objects > max_objects:
        raise ValueError(
            f"min_objects must be <= max_objects, got min_objects={min_objects}, max_objects={max_objects}"
        )
    for name, value in (("min_size", min_size), ("max_size", max_size)):
        if not _is_real(value) or not (0.0 < float(value) <= 1.0):
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

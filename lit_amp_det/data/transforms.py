"""Detection transforms on ``(image, target)`` pairs and the detection batch collate.

Each transform takes a uint8 ``[3, H, W]`` image and a torchvision-style target dict and returns the
transformed pair, keeping ``boxes`` and ``masks`` consistent with the image. Randomness is drawn only from an
explicit ``torch.Generator`` passed at call time (never from the global RNG), and every random transform draws
the same amount whatever the outcome, so a data pipeline seeded per sample replays exactly when training
resumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["Compose", "DetectionTransform", "RandomHorizontalFlip", "ToFloat", "collate_detection", "hflip"]

Target = dict[str, Tensor]


class DetectionTransform(Protocol):
    """Call signature shared by all transforms in this module."""

    def __call__(
        self, image: Tensor, target: Target, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Target]: ...


class Compose:
    """Apply transforms in order, passing the same generator to each so one seed drives them all."""

    def __init__(self, transforms: Sequence[DetectionTransform]) -> None:
        self.transforms = list(transforms)
        for position, transform in enumerate(self.transforms):
            if not callable(transform):
                raise TypeError(f"Compose: transform #{position} ({transform!r}) is not callable")

    def __call__(
        self, image: Tensor, target: Target, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Target]:
        for transform in self.transforms:
            image, target = transform(image, target, generator)
        return image, target

    def __repr__(self) -> str:
        inner = "".join(f"\n    {t!r}," for t in self.transforms)
        return f"{type(self).__name__}([{inner}\n])" if inner else f"{type(self).__name__}([])"


class RandomHorizontalFlip:
    """Mirror image, boxes and masks left-right with probability ``p``. Exactly one number is drawn from
    ``generator`` per call (even for ``p`` of 0 or 1), so the random stream does not depend on the outcome or
    on ``p``.
    """

    def __init__(self, p: float = 0.5) -> None:
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= float(p) <= 1.0:
            raise ValueError(
                f"RandomHorizontalFlip: p must be a probability in [0, 1], got {p!r} "
                "(check the flip probability in the data config)"
            )
        self.p = float(p)

    def __call__(
        self, image: Tensor, target: Target, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Target]:
        if torch.rand((), generator=generator).item() >= self.p:
            return image, target
        return hflip(image, target)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(p={self.p})"


def hflip(image: Tensor, target: Target) -> tuple[Tensor, Target]:
    """Deterministically mirror ``image`` [..., H, W] and its target; returns new tensors, inputs
    untouched.
    """
    width, out = image.shape[-1], dict(target)
    if "boxes" in target:
        boxes = target[
            "boxes"
        ]  # x1' = W - x2 and x2' = W - x1 keeps x1 <= x2 in continuous pixel coordinates
        out["boxes"] = torch.stack(
            (width - boxes[:, 2], boxes[:, 1], width - boxes[:, 0], boxes[:, 3]), dim=1
        )
    if "masks" in target:
        out["masks"] = target["masks"].flip(-1)
    return image.flip(-1), out


class ToFloat:
    """Convert a uint8 image to float32 in [0, 1] (what torchvision detection models expect)."""

    def __call__(
        self, image: Tensor, target: Target, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Target]:
        if image.dtype != torch.uint8:
            raise TypeError(
                f"ToFloat expects a uint8 image, got {image.dtype}; it must run once, after the "
                "uint8 transforms (is ToFloat listed twice in the Compose?)"
            )
        return image.to(torch.float32).div_(255.0), target

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def collate_detection(batch: Sequence[tuple[Tensor, Target]]) -> tuple[list[Tensor], list[Target]]:
    """Collate detection samples into ``(images, targets)`` lists. Images differ in size and targets in
    instance count, so nothing is stacked; the detection model batches the images itself.
    """
    return [image for image, _ in batch], [target for _, target in batch]

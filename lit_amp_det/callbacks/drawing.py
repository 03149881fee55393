"""Pictures of detections: masks, boxes, class names and scores drawn onto an image, for people to look at.

Shared by :class:`~lit_amp_det.callbacks.CocoPredictionWriter` and
:class:`~lit_amp_det.callbacks.ValidationImages`. Drawing uses torchvision's drawing utilities on the CPU and
returns ``uint8 [3, H, W]`` tensors that TensorBoard and :func:`save_png` both take. A class keeps its colour
in every picture, so ground truth and predictions compare.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import Tensor
from torchvision.transforms.v2.functional import resize
from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks

__all__ = [
    "DrawingWarning",
    "PALETTE",
    "class_names_of",
    "draw_detections",
    "draw_ground_truth",
    "save_png",
    "side_by_side",
    "to_uint8",
]

#: One RGB colour per class (class k takes ``PALETTE[(k - 1) % len(PALETTE)]``): matplotlib's tab10.
PALETTE: tuple[tuple[int, int, int], ...] = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
)
_MASK_ALPHA = 0.5  # the object stays visible under its mask
_CAPTION_HEIGHT = 12
_GAP = 4


class DrawingWarning(UserWarning):
    """A picture could not be drawn; the run went on without it. Tests turn it into an error."""


def class_names_of(pl_module: Any) -> list[str]:
    """Names of classes 1..K of a LightningModule: its ``class_names`` attribute, else
    ``hparams.class_names``.
    """
    names = getattr(pl_module, "class_names", None)
    if names is None:
        hparams = getattr(pl_module, "hparams", None)
        names = hparams.get("class_names") if isinstance(hparams, Mapping) else None
    return [str(name) for name in names] if names else []


def to_uint8(image: Tensor) -> Tensor:
    """A ``[3, H, W]`` (or ``[1, H, W]``) image, ``uint8`` or float in [0, 1], as a ``uint8 [3, H, W]`` CPU
    copy.
    """
    if image.dim() != 3 or image.shape[0] not in (1, 3):
        raise ValueError(f"image has shape {tuple(image.shape)}; expected [3, H, W] or [1, H, W]")
    image = image.detach().cpu()
    if image.dtype != torch.uint8:
        if not image.is_floating_point():
            raise ValueError(f"image has dtype {image.dtype}; expected uint8 or float in [0, 1]")
        image = image.float().clamp(0, 1).mul(255).round().to(torch.uint8)
    return image.expand(3, -1, -1).contiguous()


def _label_text(label: int, class_names: Sequence[str]) -> str:
    return class_names[label - 1] if 1 <= label <= len(class_names) else f"class {label}"


def _binary_masks(
    masks: Tensor,
    size: tuple[int, int],
    mask_threshold: float,
    order: Tensor | None = None,
    drawn: tuple[int, int] | None = None,
) -> Tensor:
    """Boolean ``[N, H, W]`` on the CPU from boolean/uint8 ``[N, H, W]`` or soft ``[N, 1, H, W]`` (Mask R-CNN)
    masks. ``order``: the masks to keep, in that order; ``drawn``: the picture's size, each of its pixels the
    nearest mask pixel. Both are taken in one gather, so no full-size copy of the masks is made on the way.
    """
    shape = tuple(masks.shape)
    if masks.dim() == 4 and masks.shape[1] == 1:
        masks = masks[:, 0]
    if masks.dim() != 3 or tuple(masks.shape[-2:]) != size:
        raise ValueError(
            f"masks have shape {shape}; expected [N, {size[0]}, {size[1]}] or "
            f"[N, 1, {size[0]}, {size[1]}] (the image's height and width)"
        )
    index = order.to(masks.device) if order is not None else torch.arange(len(masks), device=masks.device)
    if drawn is not None and drawn != size:
        rows, cols = (
            ((torch.arange(n, device=masks.device) + 0.5) * (full / n)).long().clamp_(max=full - 1)
            for n, full in zip(drawn, size)
        )
        # mask by mask: one advanced index over all of them would build [N, h, w] int64 index tensors
        shrunk = masks.new_zeros((len(index), *drawn))
        for k, i in enumerate(index.tolist()):
            shrunk[k] = masks[i].index_select(0, rows).index_select(1, cols)
        masks = shrunk
    else:
        masks = masks[index]
    masks = masks.cpu()
    return masks > mask_threshold if masks.is_floating_point() else masks.bool()


def _first_owner(masks: Tensor) -> Tensor:
    """Each pixel kept in the first mask that covers it: torchvision paints pixels of two masks black."""
    owned = masks.clone()
    taken = torch.zeros(masks.shape[-2:], dtype=torch.bool)
    for mask in owned:  # one [H, W] plane at a time: no [N, H, W] integer stack
        mask &= ~taken
        taken |= mask
    return owned


def _draw(
    image: Tensor, boxes: Tensor, labels: Tensor, texts: list[str], masks: Tensor | None, min_side: int
) -> Tensor:
    """Masks, then boxes with their captions; the first instance ends up on top of the others."""
    picture = to_uint8(image)
    if masks is not None:
        if len(masks) != len(boxes):
            raise ValueError(f"{len(masks)} masks for {len(boxes)} boxes; expected one mask per box")
        masks = _first_owner(masks)
    # whole pixels enlarged by an integer factor: the picture shows the image as it is, with readable captions
    scale = max(1, math.ceil(min_side / max(1, min(picture.shape[-2:]))))
    if scale > 1:
        picture = picture.repeat_interleave(scale, dim=-2).repeat_interleave(scale, dim=-1)
        boxes = boxes.float() * scale
        if masks is not None:
            masks = masks.repeat_interleave(scale, dim=-2).repeat_interleave(scale, dim=-1)
    if len(boxes) == 0:
        return picture  # torchvision warns on an empty set
    colors = [PALETTE[(int(label) - 1) % len(PALETTE)] for label in labels.tolist()]
    if masks is not None:
        # the masks are disjoint (first owner): one mask per colour draws the same picture, and torchvision's
        # overlap count (an int64 image per mask) stays a few planes however many detections there are
        palette = list(dict.fromkeys(colors))
        merged = torch.stack(
            [masks[[k for k, c in enumerate(colors) if c == color]].any(dim=0) for color in palette]
        )
        picture = draw_segmentation_masks(picture, merged, alpha=_MASK_ALPHA, colors=palette)
    width = max(1, round(min(picture.shape[-2:]) / 300))
    # captions on a patch of the class colour, in black or white, whichever reads better on it
    ink = [(0, 0, 0) if 0.299 * r + 0.587 * g + 0.114 * b > 140 else (255, 255, 255) for r, g, b in colors]
    # drawn last to first, so the first box and caption are not covered by the others
    return draw_bounding_boxes(
        picture,
        boxes.float().flip(0),
        labels=texts[::-1],
        colors=colors[::-1],
        width=width,
        fill_labels=True,
        label_colors=ink[::-1],
        label_background_colors=colors[::-1],
    )


def draw_detections(
    image: Tensor,
    detections: Mapping[str, Tensor],
    class_names: Sequence[str] = (),
    score_threshold: float = 0.0,
    mask_threshold: float = 0.5,
    min_side: int = 0,
    max_side: int = 0,
) -> Tensor:
    """Predicted masks, boxes, class names and scores drawn onto ``image``.

    Args:
        image: ``[3, H, W]``, ``uint8`` or float in [0, 1]: the image the detections are in the coordinates
        of. detections: ``boxes`` (``[N, 4]`` xyxy pixels), ``labels`` (``[N]``, 1..K), ``scores`` (``[N]``)
        and
            optionally ``masks``: boolean ``[N, H, W]`` or soft ``[N, 1, H, W]`` probabilities (torchvision's
            Mask R-CNN output). Without masks (Faster R-CNN) only boxes are drawn.
        class_names: names of classes 1..K; a label without one is written ``class <k>``. score_threshold:
        detections scoring below it are left out; with none left the picture says so. mask_threshold:
        probability above which a pixel of a soft mask belongs to the instance. min_side: an image whose
        shorter side is below this is enlarged ``k`` times (each pixel becomes ``k x k``,
            the smallest ``k`` that reaches it), so that captions stay readable; 0 keeps the size.
        max_side: an image whose longer side is above this is drawn shrunk to it (antialiased; each mask pixel
            the nearest one), so huge photos do not hold full-size masks; 0 keeps the size.

    Returns:
        ``uint8 [3, k*H, k*W]`` (or the shrunk size) on the CPU; the most confident detection is drawn on top.
    """
    scores = detections["scores"].detach().float().cpu()
    order = torch.argsort(scores, descending=True)
    order = order[scores[order] >= score_threshold]
    boxes, labels = detections["boxes"].detach().cpu()[order], detections["labels"].detach().cpu()[order]
    texts = [
        f"{_label_text(int(label), class_names)} {float(score):.2f}"
        for label, score in zip(labels.tolist(), scores[order].tolist())
    ]
    size = drawn = tuple(image.shape[-2:])
    if 0 < max_side < max(size):  # shrunk so that the longer side is max_side
        scale = max_side / max(size)
        drawn = max(1, round(size[0] * scale)), max(1, round(size[1] * scale))
    masks = (
        None
        if detections.get("masks") is None
        else _binary_masks(detections["masks"].detach(), size, mask_threshold, order, drawn)
    )
    if drawn != size:
        image = resize(to_uint8(image), list(drawn), antialias=True)
        boxes = boxes.float() * torch.tensor([drawn[1] / size[1], drawn[0] / size[0]] * 2)
    picture = _draw(image, boxes, labels, texts, masks, min_side)
    return picture if len(order) else _written_on(picture, f"no detections above {score_threshold:g}")


def _written_on(picture: Tensor, text: str) -> Tensor:
    """``text`` in black on a white patch in the picture's top-left corner (a picture that shows nothing says
    so).
    """
    page = Image.fromarray(picture.permute(1, 2, 0).numpy())
    draw = ImageDraw.Draw(page)
    left, top, right, bottom = draw.textbbox((2, 2), text)
    draw.rectangle((0, 0, right + 2, bottom + 2), fill=(255, 255, 255))
    draw.text((2, 2), text, fill=(0, 0, 0))
    return torch.from_numpy(np.array(page)).permute(2, 0, 1).contiguous()


def draw_ground_truth(
    image: Tensor, target: Mapping[str, Tensor], class_names: Sequence[str] = (), min_side: int = 0
) -> Tensor:
    """The annotated masks, boxes and class names of ``target`` (the dataset's target dict) drawn onto
    ``image``; crowd regions are captioned ``<name> (crowd)``. ``min_side`` as in :func:`draw_detections`.
    """
    boxes, labels = target["boxes"].detach().cpu(), target["labels"].detach().cpu()
    crowd = target["iscrowd"].detach().cpu().tolist() if "iscrowd" in target else [0] * len(labels)
    texts = [
        _label_text(int(label), class_names) + (" (crowd)" if is_crowd else "")
        for label, is_crowd in zip(labels.tolist(), crowd)
    ]
    masks = (
        None
        if target.get("masks") is None
        else _binary_masks(target["masks"].detach().cpu(), tuple(image.shape[-2:]), 0.5)
    )
    return _draw(image, boxes, labels, texts, masks, min_side)


def side_by_side(pictures: Sequence[Tensor], captions: Sequence[str]) -> Tensor:
    """``uint8 [3, H, W]`` pictures in a row, each under its caption, on a white background."""
    if not pictures or len(pictures) != len(captions):
        raise ValueError(
            f"side_by_side got {len(pictures)} pictures and {len(captions)} captions; "
            "expected as many captions as pictures, at least one"
        )
    height = max(p.shape[-2] for p in pictures) + _CAPTION_HEIGHT
    width = sum(p.shape[-1] for p in pictures) + _GAP * (len(pictures) - 1)
    canvas = torch.full((3, height, width), 255, dtype=torch.uint8)
    x = 0
    for picture in pictures:
        canvas[:, _CAPTION_HEIGHT : _CAPTION_HEIGHT + picture.shape[-2], x : x + picture.shape[-1]] = picture
        x += picture.shape[-1] + _GAP
    page = Image.fromarray(canvas.permute(1, 2, 0).numpy())
    draw = ImageDraw.Draw(page)
    x = 0
    for picture, caption in zip(pictures, captions):
        draw.text((x + 1, 0), caption, fill=(0, 0, 0))
        x += picture.shape[-1] + _GAP
    return torch.from_numpy(np.array(page)).permute(2, 0, 1).contiguous()


def save_png(picture: Tensor, path: str | Path) -> Path:
    """Writes a ``uint8 [3, H, W]`` picture as a PNG file (its folder is created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(to_uint8(picture).permute(1, 2, 0).numpy()).save(path, format="PNG")
    return path

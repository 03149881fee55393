"""Pasting each detection's mask into the image as booleans, without torchvision's float canvas per detection.

torchvision's ``GeneralizedRCNNTransform.postprocess`` pastes every detection's ``M x M`` mask probabilities
into a float32 image of the original size (a zero canvas per detection, then a stacked copy of them all), and
the caller thresholds that: gigabytes for a large photo with many detections, to produce booleans.

:func:`paste_masks_binary` computes the same thing in the order that needs no canvas: each mask is resized to
its box exactly as torchvision resizes it, compared with the threshold there, and only the boolean box region
is written into a boolean ``[N, 1, H, W]`` result, equal to ``paste_masks_in_image(...) > threshold`` bit for
bit. :class:`BinaryMaskTransform` is torchvision's transform with that paste, and
:func:`use_binary_mask_paste` installs it (``model.binary_mask_paste``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.models.detection.roi_heads import expand_boxes, expand_masks
from torchvision.models.detection.transform import GeneralizedRCNNTransform, resize_boxes, resize_keypoints

__all__ = ["BinaryMaskTransform", "paste_masks_binary", "use_binary_mask_paste"]


def paste_masks_binary(
    masks: Tensor, boxes: Tensor, image_size: tuple[int, int], threshold: float, padding: int = 1
) -> Tensor:
    """``[N, 1, M, M]`` mask probabilities in their ``[N, 4]`` boxes (x1, y1, x2, y2 in image pixels) -> ``[N,
    1, H, W]`` booleans: ``paste_masks_in_image(masks, boxes, image_size, padding) > threshold`` without its
    float canvases. Pixels outside a box compare torchvision's zero with the threshold, as its result would.
    """
    height, width = int(image_size[0]), int(image_size[1])
    count = masks.shape[0]
    pasted = torch.full((count, 1, height, width), threshold < 0.0, dtype=torch.bool, device=masks.device)
    if count == 0:
        return pasted
    padded, scale = expand_masks(masks, padding=padding)
    corners = expand_boxes(boxes, scale).to(dtype=torch.int64).tolist()  # one host copy, not 4 N item reads
    for k, (x0, y0, x1, y1) in enumerate(corners):
        box_w, box_h = max(x1 - x0 + 1, 1), max(y1 - y0 + 1, 1)
        left, right = max(x0, 0), min(x1 + 1, width)
        top, bottom = max(y0, 0), min(y1 + 1, height)
        if right <= left or bottom <= top:  # the box lies outside the image
            continue
        resized = F.interpolate(padded[k : k + 1], size=(box_h, box_w), mode="bilinear", align_corners=False)[
            0, 0
        ]
        pasted[k, 0, top:bottom, left:right] = (
            resized[top - y0 : bottom - y0, left - x0 : right - x0] > threshold
        )
    return pasted


class BinaryMaskTransform(GeneralizedRCNNTransform):
    """torchvision's detection transform whose inference output holds boolean masks
    (:func:`paste_masks_binary`).

    Resizing, normalisation, batching and the box rescaling are torchvision's own; only the mask paste
    differs, and its result is ``torchvision's masks > mask_threshold``.
    """

    def __init__(self, transform: GeneralizedRCNNTransform, mask_threshold: float) -> None:
        super().__init__(
            transform.min_size,
            transform.max_size,
            transform.image_mean,
            transform.image_std,
            size_divisible=transform.size_divisible,
            fixed_size=transform.fixed_size,
            _skip_resize=transform._skip_resize,
        )
        self.mask_threshold = float(mask_threshold)

    def postprocess(
        self,
        result: list[dict[str, Tensor]],
        image_shapes: list[tuple[int, int]],
        original_image_sizes: list[tuple[int, int]],
    ) -> list[dict[str, Tensor]]:
        if self.training:
            return result
        for pred, shape, original in zip(result, image_shapes, original_image_sizes):
            pred["boxes"] = self.rescale_boxes(pred["boxes"], shape, original)
            if "masks" in pred:
                pred["masks"] = self.paste(pred["masks"], pred["boxes"], original)
            if "keypoints" in pred:
                pred["keypoints"] = resize_keypoints(pred["keypoints"], shape, original)
        return result

    def rescale_boxes(self, boxes: Tensor, size: tuple[int, int], original_size: tuple[int, int]) -> Tensor:
        """``[N, 4]`` boxes in the resized image of ``size`` -> in the original image (torchvision's
        rescaling).
        """
        return resize_boxes(boxes, size, original_size)

    def paste(self, masks: Tensor, boxes: Tensor, image_size: tuple[int, int]) -> Tensor:
        """``[N, 1, M, M]`` probabilities in their boxes -> ``[N, 1, H, W]`` booleans at
        :attr:`mask_threshold`.
        """
        return paste_masks_binary(masks, boxes, image_size, self.mask_threshold)


def use_binary_mask_paste(detector: nn.Module, mask_threshold: float) -> bool:
    """Replaces ``detector.transform`` (torchvision's) with :class:`BinaryMaskTransform`; ``False`` when the
    detector has no such transform or predicts no masks, and nothing was switched.
    """
    transform = getattr(detector, "transform", None)
    heads = getattr(detector, "roi_heads", None)
    if type(transform) is not GeneralizedRCNNTransform or heads is None or not heads.has_mask():
        return False
    detector.transform = BinaryMaskTransform(transform, mask_threshold)
    return True

"""Pasting each detection's mask into the image as booleans, without torchvision's float canvas per detection.

torchvision's ``GeneralizedRCNNTransform.postprocess`` pastes every detection's ``M x M`` mask probabilities
into a float32 image of the original size (a zero canvas per detection, then a stacked copy of them all), and
the caller thresholds that: gigabytes for a large photo with many detections, to produce booleans.

:func:`~lit_amp_det.models.detection_core.paste_masks_binary` (the dynamic pipeline's paste, beside the
fixed-shape one) computes the same thing in the order that needs no canvas: each mask is resized to
its box exactly as torchvision resizes it, compared with the threshold there, and only the boolean box region
is written into a boolean ``[N, 1, H, W]`` result, equal to ``paste_masks_in_image(...) > threshold`` bit for
bit. :class:`BinaryMaskTransform` is torchvision's transform with that paste, and
:func:`use_binary_mask_paste` installs it (``model.binary_mask_paste``).
"""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.models.detection.transform import GeneralizedRCNNTransform, resize_boxes, resize_keypoints

from lit_amp_det.models.detection_core import paste_masks_binary

__all__ = ["BinaryMaskTransform", "paste_masks_binary", "use_binary_mask_paste"]


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

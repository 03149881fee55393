"""RoIAlign that runs natively in fp16/bf16 and pools every FPN level in one call.

Under autocast torchvision's RoIAlign copies the feature map to fp32 and the result back. These kernels read
fp16/bf16/fp32 features through their strides, channels_last included, take RoIs of any float dtype and
accumulate in fp32: no copies, same numbers. :func:`multi_level_roi_align` pools RoIs of all FPN levels
straight into one output in RoI order, replacing ``torchvision.ops.MultiScaleRoIAlign``'s zeros-then-scatter
loop over levels.

Autocast policy: no autocast kernel is registered, so both ops run in the dtype they are given and return
it; the backward accumulates in fp32 and returns the feature dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx
from torch import Tensor, nn

from lit_amp_det.ops import reference
from lit_amp_det.ops._extension import extension_available, has_kernel
from lit_amp_det.ops.layout import suggest_memory_format

__all__ = ["RoIAlign", "boxes_to_rois", "multi_level_roi_align", "roi_align"]


def _pair(size: int | Sequence[int]) -> tuple[int, int]:
    pair = (size, size) if isinstance(size, int) else tuple(int(s) for s in size)
    if len(pair) != 2 or min(pair) <= 0:
        raise ValueError(f"output_size must be a positive int or (height, width), got {size!r}")
    return pair  # type: ignore[return-value]


def _rois_from_list(boxes: list[Tensor]) -> Tensor:
    batch_index = torch.cat([torch.full_like(b[:, :1], i) for i, b in enumerate(boxes)])
    return torch.cat([batch_index, torch.cat(boxes)], dim=1)


def boxes_to_rois(boxes: Tensor | Sequence[Tensor]) -> Tensor:
    """Turns per-image boxes into the ``Tensor[K, 5]`` RoI format ``(batch_index, x1, y1, x2, y2)``.

    Args:
        boxes (Tensor[K, 5] or List[Tensor[L, 4]]): RoIs as they are, or one box tensor per image.

    Returns:
        Tensor[K, 5]: ``boxes`` itself when it is a tensor; otherwise the boxes of every image in order, each
        row led by its image's index in the list (in the boxes' dtype).

    Raises:
        ValueError: if a tensor ``boxes`` is not ``[K, 5]``, a per-image tensor is not ``[L, 4]``, or the list
            is empty.
    """
    if isinstance(boxes, Tensor):
        if boxes.dim() != 2 or boxes.shape[1] != 5:
            raise ValueError(
                f"boxes as a tensor must be [K, 5] (batch_index, x1, y1, x2, y2), got {list(boxes.shape)}"
            )
        return boxes
    for i, per_image in enumerate(boxes):
        if per_image.dim() != 2 or per_image.shape[1] != 4:
            raise ValueError(f"boxes[{i}] must be [L, 4] (x1, y1, x2, y2), got {list(per_image.shape)}")
    if len(boxes) == 0:
        raise ValueError("boxes is an empty list; give one [L, 4] tensor per image")
    return _rois_from_list(list(boxes))


@torch.fx.wrap  # a leaf for symbolic_trace, as torchvision's roi_align: the list handling is not traceable
def roi_align(
    input: Tensor,
    boxes: Tensor | list[Tensor],
    output_size: int | tuple[int, int],
    spatial_scale: float = 1.0,
    sampling_ratio: int = -1,
    aligned: bool = False,
) -> Tensor:
    """RoIAlign with torchvision's semantics (Mask R-CNN), native in fp16/bf16.

    Args:
        input (Tensor[N, C, H, W]): features, fp16/bf16/fp32/fp64, contiguous or channels_last.
        boxes (Tensor[K, 5] or List[Tensor[L, 4]]): RoIs in input-image coordinates, any float dtype. A RoI
            whose batch index is outside ``[0, N)`` pools to zeros and gets no gradient, on every device.
        output_size: ``(height, width)`` of the pooled output (any sequence of two ints), or one int for both.
        spatial_scale: feature size / image size (1/stride).
        sampling_ratio: bilinear samples per bin along each axis; <= 0 adapts to the RoI size.
        aligned: shift by -0.5 pixel (the pixel-model fix of detectron2's ``ROIAlignV2``).

    Returns:
        Tensor[K, C, output_size[0], output_size[1]] in the input dtype (channels_last if the input is).

    Scriptable with ``torch.jit.script`` when the compiled extension is loaded, like torchvision's.
    """
    if torch.jit.is_scripting():  # TorchScript compiles this branch only
        scripted_rois = boxes if isinstance(boxes, Tensor) else _rois_from_list(boxes)
        if isinstance(output_size, int):
            return torch.ops.lit_amp_det.roi_align(
                input, scripted_rois, spatial_scale, output_size, output_size, sampling_ratio, aligned
            )
        return torch.ops.lit_amp_det.roi_align(
            input, scripted_rois, spatial_scale, output_size[0], output_size[1], sampling_ratio, aligned
        )
    rois = boxes_to_rois(boxes)
    height, width = _pair(output_size)
    if has_kernel("roi_align", input.device):
        return torch.ops.lit_amp_det.roi_align(
            input, rois, float(spatial_scale), height, width, int(sampling_ratio), bool(aligned)
        )
    return reference.roi_align(input, rois, (height, width), spatial_scale, sampling_ratio, aligned)


def multi_level_roi_align(
    features: Sequence[Tensor],
    rois: Tensor,
    levels: Tensor,
    spatial_scales: Sequence[float],
    output_size: int | Sequence[int],
    sampling_ratio: int = -1,
    aligned: bool = False,
) -> Tensor:
    """RoIAlign of each RoI on its own FPN level, all levels written into one output in RoI order.

    Args:
        features (List[Tensor[N, C, H_l, W_l]]): one map per level, same N, C and dtype.
        rois (Tensor[K, 5]): ``(batch_index, x1, y1, x2, y2)``, any float dtype.
        levels (Tensor[K], int64): level of each RoI, in ``[0, len(features))``.
        spatial_scales (List[float]): 1/stride of each level.
        output_size (int or Tuple[int, int]): ``(height, width)`` of the pooled output, or one int for both.
        sampling_ratio (int): bilinear samples per bin along each axis; <= 0 adapts to the RoI size.
            Default: -1.
        aligned (bool): shift by -0.5 pixel (detectron2's ``ROIAlignV2``). Default: ``False``.

    Returns:
        Tensor[K, C, output_size[0], output_size[1]]: row k pooled from ``features[levels[k]]``.

    Raises:
        ValueError: if ``features`` and ``spatial_scales`` differ in length, or ``output_size`` is not a
            positive int or pair of positive ints.
        RuntimeError: from the CPU kernel, if the levels differ in N, C or dtype, ``rois`` is not a float
            ``[K, 5]``, or ``levels`` is not int64 ``[K]``.
        ValueError: from the CUDA (Triton) kernels, for the same shape and device checks.
        TypeError: from the CUDA (Triton) kernels, if a level or ``rois`` has an unsupported dtype.
    """
    if len(features) != len(spatial_scales):
        raise ValueError(f"got {len(features)} feature maps but {len(spatial_scales)} spatial_scales")
    height, width = _pair(output_size)
    if has_kernel("multi_level_roi_align", rois.device):
        return torch.ops.lit_amp_det.multi_level_roi_align(
            list(features),
            rois,
            levels,
            [float(s) for s in spatial_scales],
            height,
            width,
            int(sampling_ratio),
            bool(aligned),
        )
    return reference.multi_level_roi_align(
        features, rois, levels, spatial_scales, (height, width), sampling_ratio, aligned
    )


class RoIAlign(nn.Module):
    """Module form of :func:`roi_align`, a drop-in for ``torchvision.ops.RoIAlign``.

    Args:
        output_size (int or Tuple[int, int]): ``(height, width)`` of the pooled output, or one int for both.
        spatial_scale (float): feature size / image size (1/stride).
        sampling_ratio (int): bilinear samples per bin along each axis; <= 0 adapts to the RoI size.
        aligned (bool): shift by -0.5 pixel (detectron2's ``ROIAlignV2``). Default: ``False``.

    Raises:
        ValueError: if ``output_size`` is not a positive int or pair of positive ints.
    """

    def __init__(
        self,
        output_size: int | Sequence[int],
        spatial_scale: float,
        sampling_ratio: int,
        aligned: bool = False,
    ) -> None:
        super().__init__()
        self.output_size = _pair(output_size)
        self.spatial_scale = spatial_scale
        self.sampling_ratio = sampling_ratio
        self.aligned = aligned

    def forward(self, input: Tensor, rois: Tensor | list[Tensor]) -> Tensor:
        """Pools ``rois`` (``Tensor[K, 5]`` or one ``Tensor[L, 4]`` per image) -> ``Tensor[K, C,
        *output_size]``.
        """
        return roi_align(input, rois, self.output_size, self.spatial_scale, self.sampling_ratio, self.aligned)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(output_size={self.output_size}, spatial_scale={self.spatial_scale}, "
            f"sampling_ratio={self.sampling_ratio}, aligned={self.aligned})"
        )


def _empty_like_layout(reference_tensor: Tensor, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    return torch.empty(
        shape,
        dtype=dtype,
        device=reference_tensor.device,
        memory_format=suggest_memory_format(reference_tensor),
    )


def _check_rois(rois: Tensor) -> None:
    torch._check(
        rois.dim() == 2 and rois.shape[-1] == 5, lambda: f"rois must be [K, 5], got {tuple(rois.shape)}"
    )


if extension_available():

    @torch.library.register_fake("lit_amp_det::roi_align")
    def _roi_align_fake(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
        torch._check(input.dim() == 4, lambda: f"input must be [N, C, H, W], got {input.dim()}-D")
        _check_rois(rois)
        return _empty_like_layout(
            input, (rois.shape[0], input.shape[1], pooled_height, pooled_width), input.dtype
        )

    @torch.library.register_fake("lit_amp_det::_roi_align_backward")
    def _roi_align_backward_fake(
        grad,
        rois,
        spatial_scale,
        pooled_height,
        pooled_width,
        batch_size,
        channels,
        height,
        width,
        sampling_ratio,
        aligned,
    ):
        return _empty_like_layout(grad, (batch_size, channels, height, width), grad.dtype)

    def _roi_align_setup_context(ctx, inputs, output):
        input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned = inputs
        ctx.save_for_backward(rois)
        ctx.input_shape = tuple(input.shape)
        ctx.params = (spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned)

    def _roi_align_backward(ctx, grad):
        (rois,) = ctx.saved_tensors
        spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned = ctx.params
        grad_input = torch.ops.lit_amp_det._roi_align_backward(
            grad, rois, spatial_scale, pooled_height, pooled_width, *ctx.input_shape, sampling_ratio, aligned
        )
        return grad_input, None, None, None, None, None, None

    torch.library.register_autograd(
        "lit_amp_det::roi_align", _roi_align_backward, setup_context=_roi_align_setup_context
    )

    @torch.library.register_fake("lit_amp_det::multi_level_roi_align")
    def _multi_level_fake(
        features, rois, levels, spatial_scales, pooled_height, pooled_width, sampling_ratio, aligned
    ):
        torch._check(len(features) == len(spatial_scales), lambda: "one spatial scale per feature map")
        torch._check(levels.shape == rois.shape[:1], lambda: "levels must have one entry per RoI")
        _check_rois(rois)
        first = features[0]
        return _empty_like_layout(
            first, (rois.shape[0], first.shape[1], pooled_height, pooled_width), first.dtype
        )

    @torch.library.register_fake("lit_amp_det::_multi_level_roi_align_backward")
    def _multi_level_backward_fake(
        grad, features, rois, levels, spatial_scales, pooled_height, pooled_width, sampling_ratio, aligned
    ):
        return [_empty_like_layout(f, f.shape, grad.dtype) for f in features]

    def _multi_level_setup_context(ctx, inputs, output):
        features, rois, levels, spatial_scales, pooled_height, pooled_width, sampling_ratio, aligned = inputs
        # the maps are kept for their shapes and layouts only; they are alive anyway (the FPN saved them)
        ctx.save_for_backward(rois, levels, *features)
        ctx.params = (spatial_scales, pooled_height, pooled_width, sampling_ratio, aligned)

    def _multi_level_backward(ctx, grad):
        rois, levels, *features = ctx.saved_tensors
        grads = torch.ops.lit_amp_det._multi_level_roi_align_backward(
            grad, features, rois, levels, *ctx.params
        )
        return list(grads), None, None, None, None, None, None, None

    torch.library.register_autograd(
        "lit_amp_det::multi_level_roi_align", _multi_level_backward, setup_context=_multi_level_setup_context
    )

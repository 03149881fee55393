"""Drop-in ``MultiScaleRoIAlign`` that pools all FPN levels with one kernel call.

torchvision's module allocates a zeros output and, per level, selects that level's RoIs, pools them and
scatters the rows back. This one infers the levels' scales and assigns each box its level exactly as
torchvision does, then :func:`lit_amp_det.ops.multi_level_roi_align` writes every row in place in RoI order:
same output, no scatter, and one backward call. The forward's helpers are ``torch.fx.wrap``-ed, as
torchvision's are, so ``symbolic_trace`` records them as leaves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.fx
from torch import Tensor, nn

from lit_amp_det.ops.roi_align import _pair, boxes_to_rois, multi_level_roi_align, roi_align

__all__ = ["MultiScaleRoIAlign", "assign_fpn_levels", "infer_spatial_scale", "pool_levels"]


def infer_spatial_scale(feature: Tensor, image_size: Sequence[int]) -> float:
    """A level's scale (1/stride) as torchvision infers it: the power of two nearest ``height / image
    height``.

    torchvision rounds ``log2`` of the ratio and uses the *height* ratio alone; so does this, so that both
    modules pool from the same places. When the padded batch is much taller than the largest image (a batch of
    panoramas, say) that ratio can be a power of two off, in both libraries; the scales are inferred on the
    first call and kept, as in torchvision, so a first batch of ordinary images fixes them.

    Args:
        feature (Tensor[N, C, H, W]): the level's feature map; only its height is read.
        image_size (Tuple[int, int]): ``(height, width)`` of the (largest) input image.

    Returns:
        float: ``2 ** round(log2(H / image_size[0]))``, e.g. 0.25 for a stride-4 level.
    """
    # Python's round() is half-to-even like torch.round; plain floats keep torch.compile from breaking the
    # graph
    return 2.0 ** round(math.log2(float(feature.shape[-2]) / float(image_size[0])))


def assign_fpn_levels(
    boxes: Tensor | Sequence[Tensor],
    k_min: int,
    k_max: int,
    canonical_scale: int = 224,
    canonical_level: int = 4,
) -> Tensor:
    """FPN level of each box, relative to ``k_min`` (int64 ``[K]``): ``floor(k0 + log2(sqrt(area) / 224))``.

    Coordinates are cast to float32 (float64 stays) *before* the area is formed, as torchvision's
    ``box_area`` does: a half-precision area overflows beyond 256 x 256 pixels.

    Args:
        boxes (Tensor[K, 4] or List[Tensor[L, 4]]): ``(x1, y1, x2, y2)`` boxes, or one tensor per image
            (taken in order).
        k_min (int): the finest level (log2 of its stride); levels below are clamped to it.
        k_max (int): the coarsest level (log2 of its stride); levels above are clamped to it.
        canonical_scale (int): box side that maps to ``canonical_level`` (``224`` in the FPN paper).
            Default: 224.
        canonical_level (int): the level ``k0`` of a box of side ``canonical_scale``. Default: 4.

    Returns:
        Tensor[K] (int64): each box's level minus ``k_min``, in ``[0, k_max - k_min]``.
    """
    all_boxes = boxes if isinstance(boxes, Tensor) else torch.cat(list(boxes))
    all_boxes = all_boxes.to(torch.promote_types(all_boxes.dtype, torch.float32))
    area = (all_boxes[:, 2] - all_boxes[:, 0]) * (all_boxes[:, 3] - all_boxes[:, 1])
    # the 1e-6 keeps boxes of exactly canonical size on the canonical level despite rounding
    level = torch.floor(canonical_level + torch.log2(torch.sqrt(area) / canonical_scale) + 1e-6)
    return level.clamp(min=k_min, max=k_max).to(torch.int64) - k_min


@torch.fx.wrap
def _select_features(x: dict[str, Tensor], featmap_names: list[str]) -> list[Tensor]:
    features = [v for k, v in x.items() if k in featmap_names]
    if not features:
        raise KeyError(f"none of featmap_names {featmap_names} is among the feature maps {list(x)}")
    return features


@torch.fx.wrap
def _infer_scales(features: list[Tensor], image_shapes: list[tuple[int, int]]) -> list[float]:
    if not image_shapes:
        raise ValueError("image_shapes is empty; give the (height, width) of every image in the batch")
    image_size = (max(s[0] for s in image_shapes), max(s[1] for s in image_shapes))
    return [infer_spatial_scale(f, image_size) for f in features]


@torch.fx.wrap  # a leaf for symbolic_trace, as torchvision's pooling step
def pool_levels(
    features: list[Tensor],
    boxes: list[Tensor],
    scales: list[float],
    output_size: tuple[int, int],
    sampling_ratio: int,
    canonical_scale: int,
    canonical_level: int,
    aligned: bool,
) -> Tensor:
    """The pooling step of :class:`MultiScaleRoIAlign`: levels assigned as torchvision does, then one kernel
    call.
    """
    rois = boxes_to_rois(boxes)
    if len(features) == 1:
        return roi_align(features[0], rois, output_size, scales[0], sampling_ratio, aligned)
    # autocast can leave levels in different dtypes; torchvision's output takes the first level's
    features = [f.to(features[0].dtype) for f in features]
    k_min, k_max = int(-math.log2(scales[0])), int(-math.log2(scales[-1]))
    # the RoIs already hold every image's boxes in order: no second concatenation
    levels = assign_fpn_levels(rois[:, 1:], k_min, k_max, canonical_scale, canonical_level)
    return multi_level_roi_align(features, rois, levels, scales, output_size, sampling_ratio, aligned)


class MultiScaleRoIAlign(nn.Module):
    """Multi-level RoIAlign for FPN features; same constructor, ``forward`` and ``scales`` as torchvision's.

    ``scales`` (one float per level) is inferred from the first batch and kept, as torchvision does.
    TorchScript is not supported (PyTorch deprecated it): use ``torch.compile`` or ``torch.export``, which
    trace through the ops' fake kernels, or ``torchvision.ops.MultiScaleRoIAlign`` for a scripted model.

    Args:
        featmap_names (List[str]): keys of the feature dict to pool from (others, like the max-pool level,
            are ignored).
        output_size (int or Tuple[int, int]): pooled ``(height, width)`` or one int.
        sampling_ratio (int): bilinear samples per bin along each axis (<= 0: adaptive).
        canonical_scale (int): box side that maps to ``canonical_level`` in the FPN level mapping.
            Default: 224.
        canonical_level (int): the FPN level of a box of side ``canonical_scale``. Default: 4.
        aligned (bool): pixel-shifted RoIAlign (torchvision's module always uses ``aligned=False``).
            Default: ``False``.

    Raises:
        TypeError: if ``featmap_names`` is a string rather than a list of names.
        ValueError: if ``output_size`` is not a positive int or pair of positive ints.
    """

    def __init__(
        self,
        featmap_names: list[str],
        output_size: int | Sequence[int],
        sampling_ratio: int,
        *,
        canonical_scale: int = 224,
        canonical_level: int = 4,
        aligned: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(featmap_names, str):
            raise TypeError(f"featmap_names must be a list of names, got the string {featmap_names!r}")
        self.featmap_names = list(featmap_names)
        self.output_size = _pair(output_size)
        self.sampling_ratio = sampling_ratio
        self.canonical_scale = canonical_scale
        self.canonical_level = canonical_level
        self.aligned = aligned
        self.scales: list[float] | None = None

    def forward(
        self, x: dict[str, Tensor], boxes: list[Tensor], image_shapes: list[tuple[int, int]]
    ) -> Tensor:
        """Pools ``boxes`` (one ``Tensor[L_i, 4]`` per image) -> ``Tensor[sum L_i, C, *output_size]``."""
        features = _select_features(x, self.featmap_names)
        scales = self.scales if self.scales is not None else _infer_scales(features, image_shapes)
        if self.scales is None and not isinstance(
            scales, torch.fx.Proxy
        ):  # never keep a tracer's placeholder
            self.scales = scales
        return self._pool(features, boxes, scales)

    def _pool(self, features: list[Tensor], boxes: list[Tensor], scales: list[float]) -> Tensor:
        """Pools with the package's ops (an fx leaf)."""
        return pool_levels(
            features,
            boxes,
            scales,
            self.output_size,
            self.sampling_ratio,
            self.canonical_scale,
            self.canonical_level,
            self.aligned,
        )

    def __prepare_scriptable__(self) -> nn.Module:
        raise RuntimeError(
            "lit_amp_det.ops.MultiScaleRoIAlign cannot be compiled with torch.jit.script (TorchScript "
            "is deprecated by PyTorch): use torch.compile or torch.export instead, which trace "
            "through the op's fake kernels, or build the model with speedups.ext_ops=null "
            "(torchvision's ops) for a scriptable one"
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(featmap_names={self.featmap_names}, output_size={self.output_size}, "
            f"sampling_ratio={self.sampling_ratio})"
        )

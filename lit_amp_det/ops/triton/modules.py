"""The module forms of the Triton ops: :class:`lit_amp_det.ops.RoIAlign` and
:class:`~lit_amp_det.ops.MultiScaleRoIAlign` (same constructors, forward, scales and level mapping) pooling
with the Triton kernels.
"""

from __future__ import annotations

from torch import Tensor

from lit_amp_det.ops.poolers import MultiScaleRoIAlign as _CompiledMultiScaleRoIAlign
from lit_amp_det.ops.poolers import pool_levels
from lit_amp_det.ops.roi_align import RoIAlign as _CompiledRoIAlign
from lit_amp_det.ops.triton import multi_level_roi_align, roi_align

__all__ = ["MultiScaleRoIAlign", "RoIAlign"]


class RoIAlign(_CompiledRoIAlign):
    """Module form of :func:`roi_align` (the Triton kernels), a drop-in for ``torchvision.ops.RoIAlign``."""

    def forward(self, input: Tensor, rois: Tensor | list[Tensor]) -> Tensor:
        return roi_align(input, rois, self.output_size, self.spatial_scale, self.sampling_ratio, self.aligned)


class MultiScaleRoIAlign(_CompiledMultiScaleRoIAlign):
    """:class:`lit_amp_det.ops.MultiScaleRoIAlign` (torchvision's constructor, forward, scales and level
    mapping) pooling with the Triton kernels.
    """

    def _pool(self, features: list[Tensor], boxes: list[Tensor], scales: list[float]) -> Tensor:
        return pool_levels(
            features,
            boxes,
            scales,
            self.output_size,
            self.sampling_ratio,
            self.canonical_scale,
            self.canonical_level,
            self.aligned,
            roi_align_fn=roi_align,
            multi_level_fn=multi_level_roi_align,
        )

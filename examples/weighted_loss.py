"""A research module: Mask R-CNN with re-weighted losses and a GroupNorm mask head, keeping the configured
speedups.

Run it without touching lit_amp_det (from the repository root):

    PYTHONPATH=examples python -m lit_amp_det fit model._target_=weighted_loss.WeightedLossMaskRCNN \
        +model.loss_weights.loss_mask=2.0
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads

from lit_amp_det import MaskRCNNModule
from lit_amp_det.models.speedups import ModelTransform


class WeightedLossMaskRCNN(MaskRCNNModule):
    """Scales individual losses and swaps the mask head for a GroupNorm one."""

    def __init__(self, *args, loss_weights: Mapping[str, float] | None = None, **kwargs) -> None:
        self.loss_weights = dict(loss_weights or {})
        super().__init__(*args, **kwargs)

    def build_model(self) -> nn.Module:
        model = super().build_model()
        if self.hparams.mask:
            head = model.roi_heads.mask_head
            channels = head[0][0].in_channels
            layers = [m[0].out_channels for m in head]
            model.roi_heads.mask_head = MaskRCNNHeads(
                channels, layers, 1, norm_layer=lambda c: nn.GroupNorm(min(8, c), c)
            )
        return model

    def model_transforms(self) -> list[ModelTransform]:
        # build_model is overridden, so the speedups are off unless asked for: the detector is still
        # torchvision's with another mask head, which every speedup (ext ops, binary mask paste,
        # channels_last, compile) leaves be
        return list(self.configured_speedups)

    def compute_loss(self, loss_dict: Mapping[str, Tensor]) -> Tensor:
        return torch.stack([v.float() * self.loss_weights.get(k, 1.0) for k, v in loss_dict.items()]).sum()

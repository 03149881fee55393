"""A research subclass with its own ``force_fp32`` method, run through the CLI by test_precision_cli."""

from __future__ import annotations

import torch

from lit_amp_det import MaskRCNNModule
from lit_amp_det.precision import force_fp32, mixed_precision_dtype


class FeatureStatsMaskRCNN(MaskRCNNModule):
    """Computes a statistic of the FPN output in an fp32 region and fails loudly if the region is not fp32."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fp32_checks = 0
        self.model.backbone.register_forward_hook(self._inspect_features)

    def _inspect_features(self, module, inputs, output) -> None:
        self.feature_energy(output["0"])  # returns None: a forward hook must not replace the output

    @force_fp32(apply_to=("feature",))
    def feature_energy(self, feature: torch.Tensor) -> torch.Tensor:
        if mixed_precision_dtype(self) is not None:
            if feature.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
                raise RuntimeError(
                    f"fp32 region saw {feature.dtype}, autocast={torch.is_autocast_enabled('cpu')}"
                )
            self.fp32_checks += 1
        return feature.pow(2).mean()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/fp32_checks", float(self.fp32_checks))
        return loss

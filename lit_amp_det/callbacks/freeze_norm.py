"""Freezes normalisation (and optionally the first ResNet stages) for detection fine-tuning.

Detection batches are too small for BatchNorm statistics, so fine-tuning keeps the pretrained ones fixed;
``requires_grad=False`` does not (BatchNorm in train mode still uses and updates batch statistics), nor does
Lightning's ``BaseFinetuning``. :class:`FreezeNorm` offers the two standard ways:

* ``mode="norm_eval"`` (MMDetection): every BatchNorm is put back in eval mode at each training epoch start
  and before each training batch, so no ``train()`` call can switch it back; weight and bias may still train.
* ``mode="frozen_bn"`` (detectron2): every BatchNorm2d is replaced in ``setup()``, before
  ``configure_optimizers``, by the buffers-only :class:`lit_amp_det.models.norms.FrozenBatchNorm2d`.

``frozen_stages`` follows MMDetection for the ResNet trunk at ``pl_module.model.backbone.body``: -1 freezes
nothing, 0 the stem (conv1 + bn1), k the stem and layer1..layerk. State-dict keys do not change, so
checkpoints load with or without this callback. The model config (``model.backbone.norm`` /
``trainable_layers``) says what the model *is*; this callback is a training policy on top that only ever
freezes more, so with both set their union is frozen.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torchvision.ops import FrozenBatchNorm2d as _AnyFrozenBatchNorm2d
from typing_extensions import override

from lit_amp_det.errors import ArgumentError
from lit_amp_det.models.norms import convert_frozen_batchnorm

__all__ = ["FreezeNorm"]

_MODES = ("norm_eval", "frozen_bn")
#: BatchNorms whose running statistics move in train mode (norm_eval puts them in eval mode).
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class FreezeNorm(Callback):
    """Keeps BatchNorm statistics fixed during training and freezes the first ``frozen_stages`` ResNet stages.

    Args:
        mode: ``"norm_eval"`` (BatchNorm kept in eval mode) or ``"frozen_bn"`` (swapped for buffers-only
            :class:`~lit_amp_det.models.norms.FrozenBatchNorm2d`).
        affine_trainable: ``norm_eval`` only: whether BatchNorm weight and bias keep training.
        frozen_stages: -1 nothing, 0 the stem (conv1, bn1), k in 1..4 the stem and layer1..layerk of the
            ResNet at ``pl_module.model.backbone.body``.
    """

    def __init__(
        self, mode: str = "norm_eval", affine_trainable: bool = True, frozen_stages: int = -1
    ) -> None:
        if mode not in _MODES:
            raise ArgumentError("mode", mode, f"is unknown; choose one of {list(_MODES)}")
        if not isinstance(affine_trainable, bool):
            raise ArgumentError("affine_trainable", affine_trainable, "must be true or false")
        if (
            isinstance(frozen_stages, bool)
            or not isinstance(frozen_stages, int)
            or not -1 <= frozen_stages <= 4
        ):
            raise ArgumentError(
                "frozen_stages",
                frozen_stages,
                "must be an integer in [-1, 4]: -1 freezes nothing, "
                "0 the stem (conv1, bn1), k the stem and layer1..layerk",
            )
        self.mode, self.affine_trainable, self.frozen_stages = mode, affine_trainable, frozen_stages

    @property
    def frozen_stage_names(self) -> list[str]:
        """The ResNet trunk's children that ``frozen_stages`` freezes, e.g. ``["conv1", "bn1", "layer1"]``."""
        if self.frozen_stages < 0:
            return []
        return ["conv1", "bn1", *(f"layer{k}" for k in range(1, self.frozen_stages + 1))]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Swaps norms (frozen_bn) and turns off gradients, before ``configure_optimizers`` runs; eval mode
        comes at ``on_train_epoch_start`` (Lightning warns about modules in eval mode when training starts).
        """
        self._frozen_stages(pl_module)  # fails before the model is changed
        if self.mode == "frozen_bn":
            convert_frozen_batchnorm(pl_module)
        elif not self.affine_trainable:
            for norm in _batch_norms(pl_module):
                norm.requires_grad_(False)
        for module in self._frozen_stages(pl_module):  # after the swap: bn1 may be a new module
            module.requires_grad_(False)
        if not any(isinstance(m, (*_BATCH_NORMS, _AnyFrozenBatchNorm2d)) for m in pl_module.modules()):
            rank_zero_warn(
                f"FreezeNorm(mode={self.mode!r}) found no BatchNorm in {type(pl_module).__name__}; it "
                "freezes no statistics (remove the callback if that is expected)"
            )

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._keep_frozen(pl_module)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # also per batch: validation, other callbacks or user code may call train() mid-epoch
        self._keep_frozen(pl_module)

    def _keep_frozen(self, pl_module: pl.LightningModule) -> None:
        for module in self._frozen_stages(pl_module):
            module.eval()
        if self.mode == "norm_eval":
            for norm in _batch_norms(pl_module):
                norm.eval()

    def _frozen_stages(self, pl_module: pl.LightningModule) -> list[nn.Module]:
        """The stem and stages to freeze, looked up each time (other code may swap modules, e.g.
        SyncBatchNorm).
        """
        names = self.frozen_stage_names
        if not names:
            return []
        body: Any = pl_module  # pl_module.model.backbone.body, or an error naming what is missing and the fix
        path = type(pl_module).__name__
        for attr in ("model", "backbone", "body"):
            body = getattr(body, attr, None)
            path += f".{attr}"
            if not isinstance(body, nn.Module):
                raise ValueError(
                    f"FreezeNorm(frozen_stages={self.frozen_stages}) needs a torchvision ResNet trunk at "
                    "pl_module.model.backbone.body (a Mask R-CNN built by lit_amp_det.models."
                    f"build_detector), but {path} is missing; set frozen_stages=-1 to freeze norms only"
                )
        missing = [name for name in names if not isinstance(getattr(body, name, None), nn.Module)]
        if missing:
            present = [name for name, _ in body.named_children()]
            raise ValueError(
                f"FreezeNorm(frozen_stages={self.frozen_stages}) freezes {names}, but the ResNet trunk "
                f"at model.backbone.body has no {missing} (it has {present}); lower frozen_stages, or "
                "return that stage from the backbone (its returned_layers)"
            )
        return [getattr(body, name) for name in names]

    @override
    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(mode={self.mode!r}, affine_trainable={self.affine_trainable}, "
            f"frozen_stages={self.frozen_stages})"
        )


def _batch_norms(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, _BATCH_NORMS)]

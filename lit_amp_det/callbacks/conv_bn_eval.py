"""Trains ``Conv2d -> BatchNorm`` pairs in tune mode while their norms are in eval mode (``norm_eval``).

With the norm on its running statistics, each pair runs as one convolution whose weight is folded on the fly:
same outputs and gradients, but the conv output is not kept for BatchNorm's backward
(:mod:`lit_amp_det.models.conv_bn`). The module tree and ``state_dict`` are unchanged, so checkpoints load
with and without this callback.
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lit_amp_det.errors import ArgumentError
from lit_amp_det.models.conv_bn import (
    conv_bn_eval_pairs,
    disable_conv_bn_eval,
    enable_conv_bn_eval,
    fold_conv_bn,
)

__all__ = ["ConvBNEval"]


def _target(pl_module: LightningModule) -> nn.Module:
    """``pl_module.model`` (the detector of :class:`lit_amp_det.MaskRCNNModule`), else the module itself."""
    model = getattr(pl_module, "model", None)
    return model if isinstance(model, nn.Module) else pl_module


class ConvBNEval(Callback):
    """Folds each conv-BN pair of ``pl_module.model`` on the fly whenever its norm uses running statistics.

    Installed in ``setup()`` (an error if the model has no pair), checked again when fit, validation, test or
    prediction starts (a strategy may have replaced norms, e.g. ``sync_batchnorm``), removed in
    ``teardown()``.

    Args:
        only_when_cheaper: fold a call only when that saves memory kept for backward: a BatchNorm pair whose
            conv output outweighs the folded weight copy, or any pair without gradients (see
            :func:`~lit_amp_det.models.conv_bn.enable_conv_bn_eval`); ``False`` folds every call.
        fold_on_predict: before ``trainer.predict``, fold the pairs permanently (conv weight and bias folded,
            norms replaced by ``nn.Identity``): one conv per pair at inference. The model stays folded.
    """

    def __init__(self, only_when_cheaper: bool = True, fold_on_predict: bool = False) -> None:
        for name, value in (("only_when_cheaper", only_when_cheaper), ("fold_on_predict", fold_on_predict)):
            if not isinstance(value, bool):
                raise ArgumentError(name, value, "must be true or false")
        self.only_when_cheaper, self.fold_on_predict = only_when_cheaper, fold_on_predict
        self._pairs: list[tuple[str, str]] = []

    def _enable(self, model: nn.Module) -> None:
        self._pairs = enable_conv_bn_eval(model, only_when_cheaper=self.only_when_cheaper)
        if not self._pairs:
            raise ValueError(
                f"ConvBNEval found no Conv2d -> BatchNorm2d/FrozenBatchNorm2d pair in "
                f"{type(model).__name__} (the conv output must feed nothing but the norm); remove the "
                "callback, or use a backbone with conv-BN blocks (the backbone's norm bn or frozen_bn); a "
                "model folded by fold_on_predict has no pair left"
            )

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._enable(_target(pl_module))
        mode = (
            "when it saves memory: BatchNorm pairs whose output outweighs the conv weight"
            if (self.only_when_cheaper)
            else "on every call"
        )
        rank_zero_info(
            f"ConvBNEval: {len(self._pairs)} conv-BN pairs fold while their norm uses running statistics "
            f"({mode})"
        )

    def _refresh(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Re-installs when the strategy replaced modules after ``setup`` (BatchNorm -> SyncBatchNorm)."""
        model = _target(pl_module)
        if conv_bn_eval_pairs(model) != self._pairs:
            self._enable(model)

    on_fit_start = on_validation_start = on_test_start = _refresh

    @override
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.fold_on_predict:
            self._refresh(trainer, pl_module)
            return
        fold_conv_bn(_target(pl_module))  # Lightning has put the model in eval mode already
        rank_zero_info(f"ConvBNEval: folded {len(self._pairs)} conv-BN pairs permanently for prediction")

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        disable_conv_bn_eval(_target(pl_module))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(only_when_cheaper={self.only_when_cheaper}, "
            f"fold_on_predict={self.fold_on_predict})"
        )

"""What callbacks may read of the precision plugin that runs: its GradScaler, its low dtype and its guard.

Every plugin :func:`~lit_amp_det.precision.build.build_precision_plugin` builds is a
:class:`DetectionPrecision`; callbacks reach it through :func:`detection_precision`, one typed predicate,
instead of probing the Trainer's plugin for attributes. A plugin that a user passes to the Trainer themselves
(Lightning's own ``MixedPrecision``, say) is not one: callbacks then see no plugin (no loss scaling they can
replay, no guard), as a run without lit_amp_det's plugins computes. :func:`loss_scaler` is the one exception,
for a callback that only reads the current loss scale, which Lightning's ``MixedPrecision`` exposes too.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lit_amp_det.precision.guard import NonFiniteStepGuard

__all__ = ["DetectionPrecision", "detection_precision", "loss_scaler"]


class DetectionPrecision:
    """The interface lit_amp_det's precision plugins share with the callbacks that replay or measure a step.

    A mixin beside Lightning's ``Precision`` (``class FiniteStepPrecision(Precision, DetectionPrecision)``):
    each plugin sets the three attributes in its constructor, and :func:`detection_precision` recognises the
    plugin by this class.

    Attributes:
        scaler: the GradScaler that scales the loss and steps the optimizer (``16-mixed``, ``16-weights``);
            ``None`` where the optimizer steps through :attr:`guard` (``32-true`` and the bf16 precisions).
        low_dtype: the dtype that autocast or the low-precision weights compute in (``torch.float16`` or
            ``torch.bfloat16``); ``None`` for ``32-true``.
        guard: the non-finite step guard, which skips or counts the steps with inf/NaN gradients.
    """

    scaler: torch.amp.GradScaler | None
    low_dtype: torch.dtype | None
    guard: NonFiniteStepGuard


def detection_precision(trainer: pl.Trainer) -> DetectionPrecision | None:
    """The Trainer's precision plugin when it is one of lit_amp_det's.

    Args:
        trainer: the Trainer whose ``precision_plugin`` is read.

    Returns:
        The plugin, or ``None`` for any other plugin (one the user passed to the Trainer).
    """
    plugin = trainer.precision_plugin
    return plugin if isinstance(plugin, DetectionPrecision) else None


def loss_scaler(plugin: Precision) -> torch.amp.GradScaler | None:
    """The GradScaler that scales the loss under ``plugin``: lit_amp_det's plugins' or Lightning's
    ``MixedPrecision``'s.

    Args:
        plugin: a Trainer's ``precision_plugin``.

    Returns:
        The GradScaler, or ``None`` where the loss is not scaled.
    """
    if isinstance(plugin, (DetectionPrecision, MixedPrecision)):
        return plugin.scaler
    return None

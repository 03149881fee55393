"""The precision plugin for a ``trainer.precision`` value, and the precision a checkpoint was trained in.

Lightning refuses a precision string and a precision plugin together, so ``trainer.precision`` and the
``precision`` config node become one of lit_amp_det's plugins here: :class:`~lit_amp_det.precision.full.
FiniteStepPrecision` (``32-true``), :class:`~lit_amp_det.precision.mixed.DetectionMixedPrecision` (``-mixed``)
or :class:`~lit_amp_det.precision.low_precision_weights.MasterWeightPrecision` (``-weights``). Each records
the precision that ran in its checkpoint state, which :func:`trained_precision` reads back so that a resume in
another precision can say so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import rank_zero_warn

from lit_amp_det.precision.full import FiniteStepPrecision
from lit_amp_det.precision.guard import MAX_CONSECUTIVE_SKIPS, SKIP_CHECK_EVERY_N_STEPS
from lit_amp_det.precision.hardware import resolve_precision
from lit_amp_det.precision.low_precision_weights import MasterWeightPrecision
from lit_amp_det.precision.mixed import DetectionMixedPrecision
from lit_amp_det.precision.modes import LOW_PRECISION_WEIGHTS, PRECISIONS, RegionMode
from lit_amp_det.precision.options import GROWTH_INTERVAL, INIT_SCALE
from lit_amp_det.precision.state import PRECISION_KEY
from lit_amp_det.settings import PrecisionSettings

__all__ = ["build_precision_plugin", "check_precision", "trained_precision", "warn_if_precision_changes"]

#: the plugins whose checkpoint state records the precision (Lightning saves it under the class's
#: ``__qualname__``)
_RECORDING_PLUGINS = (FiniteStepPrecision, DetectionMixedPrecision, MasterWeightPrecision)


def check_precision(precision: object) -> None:
    """The one check of ``trainer.precision``: :func:`build_precision_plugin` runs it where the plugin is
    built, and the command line (:func:`lit_amp_det.app.config.check_config`) before anything heavy is.

    Args:
        precision: the ``trainer.precision`` value.

    Raises:
        ValueError: ``precision`` is not one of :data:`~lit_amp_det.precision.modes.PRECISIONS`; the message
            names the setting, the value and the accepted values.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.precision={precision!r}; choose one of {', '.join(PRECISIONS)}")


def build_precision_plugin(
    precision: str,
    accelerator: str = "auto",
    *,
    fp32_regions: Mapping[str, RegionMode] | None = None,
    init_scale: float = INIT_SCALE,
    growth_interval: int = GROWTH_INTERVAL,
    fp16_on_cpu: bool = PrecisionSettings.fp16_on_cpu,
    max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS,
    skip_check_every_n_steps: int = SKIP_CHECK_EVERY_N_STEPS,
) -> Precision:
    """The plugin for ``trainer.precision`` with the ``precision`` config node's settings.

    ``auto`` and the half precisions on a CPU first become what runs fast there
    (:func:`~lit_amp_det.precision.hardware.resolve_precision`: ``32-true`` on a CPU without native bf16);
    the plugin's ``precision`` attribute is what runs. The keywords' defaults are those of
    :class:`~lit_amp_det.settings.PrecisionSettings`, the ``precision`` node's.

    Args:
        precision: the ``trainer.precision`` value, one of :data:`~lit_amp_det.precision.modes.PRECISIONS`.
        accelerator: ``trainer.accelerator``; ``auto``, ``gpu`` and ``cuda`` mean CUDA where there is one.
        fp32_regions: method paths of the module mapped to ``fp32`` or ``fp32_outputs``; ``None``: the
            module's ``fp32_regions()``; ``{}``: plain autocast.
        init_scale: GradScaler's first loss scale (fp16 precisions).
        growth_interval: overflow-free steps before GradScaler doubles the scale (fp16 precisions).
        fp16_on_cpu: run ``16-mixed`` / ``16-weights`` in fp16 on a CPU too, not as their bf16 variant.
        max_consecutive_skips: skipped (non-finite) steps in a row that stop the fit.
        skip_check_every_n_steps: optimizer steps between two host reads of the guard's counts.

    Returns:
        :class:`~lit_amp_det.precision.full.FiniteStepPrecision`,
        :class:`~lit_amp_det.precision.mixed.DetectionMixedPrecision` or
        :class:`~lit_amp_det.precision.low_precision_weights.MasterWeightPrecision`.

    Raises:
        ValueError: an unknown ``precision`` (:func:`check_precision`), or a setting out of range (the
            guard's).
    """
    check_precision(precision)
    device = "cuda" if str(accelerator) in ("auto", "gpu", "cuda") and torch.cuda.is_available() else "cpu"
    precision = resolve_precision(precision, device, fp16_on_cpu)
    guard = {
        "max_consecutive_skips": max_consecutive_skips,
        "skip_check_every_n_steps": skip_check_every_n_steps,
    }
    if precision == "32-true":
        return FiniteStepPrecision(**guard)
    options: dict[str, Any] = {
        "fp32_regions": fp32_regions,
        "init_scale": init_scale,
        "growth_interval": growth_interval,
        **guard,
    }
    if precision in LOW_PRECISION_WEIGHTS:
        return MasterWeightPrecision(precision, device, **options)  # type: ignore[arg-type]
    return DetectionMixedPrecision(precision, device, **options)  # type: ignore[arg-type]


def trained_precision(checkpoint: Mapping[str, Any]) -> str | None:
    """The ``trainer.precision`` that ran when a Lightning ``checkpoint`` was saved.

    Args:
        checkpoint: the loaded checkpoint dict.

    Returns:
        The precision, or ``None`` for a checkpoint of another precision plugin, or one saved before the
        plugins recorded it.
    """
    for plugin in _RECORDING_PLUGINS:
        state = checkpoint.get(plugin.__qualname__)
        if isinstance(state, Mapping) and isinstance(state.get(PRECISION_KEY), str):
            return str(state[PRECISION_KEY])
    return None


def warn_if_precision_changes(checkpoint: Mapping[str, Any], source: str, running: str) -> str | None:
    """Warns when a fit resumes ``checkpoint`` (read from ``source``) in another precision than trained it.

    Resuming across precisions works (weights, optimizer and schedule carry over; fp32 master weights are the
    checkpoint's weights under ``*-weights``), but the steps that follow compute differently: typically
    ``trainer.precision=auto`` chose ``32-true`` on a CPU without native bf16 for a run started in
    ``bf16-mixed`` on one with it.

    Args:
        checkpoint: the loaded checkpoint dict.
        source: where it was read from, as the user gave it (``ckpt_path=...``), for the message.
        running: the precision the fit runs in (the plugin's, ``auto`` resolved).

    Returns:
        The warning, or ``None`` when nothing changed or the checkpoint does not say.
    """
    trained = trained_precision(checkpoint)
    if trained is None or trained == running:
        return None
    message = (
        f"{source} was trained in {trained}; this fit continues it in {running} (the weights, optimizer "
        f"and schedule carry over, the arithmetic of the steps changes). Pass trainer.precision={trained} "
        "to continue as it was trained."
    )
    rank_zero_warn(message)
    return message

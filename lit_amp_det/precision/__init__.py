"""Mixed precision for detection: casting helpers, fp32 regions, low-precision weights with fp32 masters, the
non-finite step guard, and the Lightning precision plugins built from ``trainer.precision``.

:func:`force_fp32` / :func:`auto_fp16` mark methods of research modules; they take effect whenever the plugin
(built by :func:`build_precision_plugin`) turns mixed precision on for the module, and are no-ops otherwise.
:func:`use_low_precision_weights` is what ``trainer.precision=bf16-weights|16-weights`` does to the model;
:func:`resolve_precision` is what ``trainer.precision=auto`` runs on a device (bf16 only where the CPU
computes it natively). Callbacks read the running plugin through :func:`detection_precision`. One module per
job: ``casting`` (casts and regions on methods), ``regions`` (fp32 regions of a model), ``master_weights``
(the weights conversion), ``skip`` and ``guard`` (the non-finite step guard), ``options`` (the settings both
half-precision plugins take), ``full`` / ``mixed`` / ``low_precision_weights`` (the plugins), ``plugin``
(what callbacks read of them), ``state`` and ``build`` (checkpoint state, plugin from config). The names are
imported on first access, so the accepted values in :mod:`lit_amp_det.precision.modes` can be read without
importing torch or Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it
_MODULES = {
    **dict.fromkeys(
        (
            "auto_fp16",
            "cast_tensor_type",
            "force_fp32",
            "mixed_precision_dtype",
            "set_mixed_precision",
            "wrap_method",
            "unwrap_method",
        ),
        "casting",
    ),
    **dict.fromkeys(("MasterWeights", "use_low_precision_weights"), "master_weights"),
    **dict.fromkeys(("cpu_computes_bf16_natively", "resolve_precision"), "hardware"),
    "install_fp32_regions": "regions",
    "NonFiniteStepGuard": "guard",
    "HalfPrecisionOptions": "options",
    "FiniteStepPrecision": "full",
    "DetectionMixedPrecision": "mixed",
    "MasterWeightPrecision": "low_precision_weights",
    **dict.fromkeys(("DetectionPrecision", "detection_precision", "loss_scaler"), "plugin"),
    **dict.fromkeys(("build_precision_plugin", "trained_precision", "warn_if_precision_changes"), "build"),
}

__all__ = list(_MODULES)

if TYPE_CHECKING:  # the lazy names, for type checkers (``name as name``: an explicit re-export)
    from lit_amp_det.precision.build import build_precision_plugin as build_precision_plugin
    from lit_amp_det.precision.build import trained_precision as trained_precision
    from lit_amp_det.precision.build import warn_if_precision_changes as warn_if_precision_changes
    from lit_amp_det.precision.casting import auto_fp16 as auto_fp16
    from lit_amp_det.precision.casting import cast_tensor_type as cast_tensor_type
    from lit_amp_det.precision.casting import force_fp32 as force_fp32
    from lit_amp_det.precision.casting import mixed_precision_dtype as mixed_precision_dtype
    from lit_amp_det.precision.casting import set_mixed_precision as set_mixed_precision
    from lit_amp_det.precision.casting import unwrap_method as unwrap_method
    from lit_amp_det.precision.casting import wrap_method as wrap_method
    from lit_amp_det.precision.full import FiniteStepPrecision as FiniteStepPrecision
    from lit_amp_det.precision.guard import NonFiniteStepGuard as NonFiniteStepGuard
    from lit_amp_det.precision.hardware import cpu_computes_bf16_natively as cpu_computes_bf16_natively
    from lit_amp_det.precision.hardware import resolve_precision as resolve_precision
    from lit_amp_det.precision.low_precision_weights import MasterWeightPrecision as MasterWeightPrecision
    from lit_amp_det.precision.master_weights import MasterWeights as MasterWeights
    from lit_amp_det.precision.master_weights import use_low_precision_weights as use_low_precision_weights
    from lit_amp_det.precision.mixed import DetectionMixedPrecision as DetectionMixedPrecision
    from lit_amp_det.precision.options import HalfPrecisionOptions as HalfPrecisionOptions
    from lit_amp_det.precision.plugin import DetectionPrecision as DetectionPrecision
    from lit_amp_det.precision.plugin import detection_precision as detection_precision
    from lit_amp_det.precision.plugin import loss_scaler as loss_scaler
    from lit_amp_det.precision.regions import install_fp32_regions as install_fp32_regions


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'lit_amp_det.precision' has no attribute {name!r}")
    globals()[name] = value = getattr(
        importlib.import_module(f"lit_amp_det.precision.{_MODULES[name]}"), name
    )
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""Mixed precision for detection: casting helpers, fp32 regions, low-precision weights with fp32 masters, and the
Lightning precision plugins.

:func:`force_fp32` / :func:`auto_fp16` mark methods of research modules; they take effect whenever the
plugin (built from ``trainer.precision``) turns mixed precision on for the module, and are no-ops otherwise.
:func:`use_low_precision_weights` is what ``trainer.precision=bf16-weights|16-weights`` does to the model;
:func:`resolve_precision` is what ``trainer.precision=auto`` runs on a device (bf16 only where the CPU computes it
natively).
The names are imported on first access, so the accepted values in :mod:`lit_amp_det.precision.modes` can be read
without importing torch or Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "auto_fp16",
    "cast_tensor_type",
    "force_fp32",
    "mixed_precision_dtype",
    "set_mixed_precision",
    "wrap_method",
    "unwrap_method",
    "DetectionMixedPrecision",
    "FiniteStepPrecision",
    "MasterWeightPrecision",
    "MasterWeights",
    "NonFiniteStepGuard",
    "build_precision_plugin",
    "cpu_computes_bf16_natively",
    "install_fp32_regions",
    "resolve_precision",
    "trained_precision",
    "use_low_precision_weights",
]

_CASTING = {"auto_fp16", "cast_tensor_type", "force_fp32", "mixed_precision_dtype", "set_mixed_precision",
            "wrap_method", "unwrap_method"}
_MASTER_WEIGHTS = {"MasterWeights", "use_low_precision_weights"}
_HARDWARE = {"cpu_computes_bf16_natively", "resolve_precision"}

if TYPE_CHECKING:
    from lit_amp_det.precision.casting import (
        auto_fp16,
        cast_tensor_type,
        force_fp32,
        mixed_precision_dtype,
        set_mixed_precision,
        unwrap_method,
        wrap_method,
    )
    from lit_amp_det.precision.hardware import cpu_computes_bf16_natively, resolve_precision
    from lit_amp_det.precision.master_weights import MasterWeights, use_low_precision_weights
    from lit_amp_det.precision.plugin import (
        DetectionMixedPrecision,
        FiniteStepPrecision,
        MasterWeightPrecision,
        NonFiniteStepGuard,
        build_precision_plugin,
        install_fp32_regions,
        trained_precision,
    )


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'lit_amp_det.precision' has no attribute {name!r}")
    module = "lit_amp_det.precision.plugin"
    if name in _CASTING:
        module = "lit_amp_det.precision.casting"
    elif name in _MASTER_WEIGHTS:
        module = "lit_amp_det.precision.master_weights"
    elif name in _HARDWARE:
        module = "lit_amp_det.precision.hardware"
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

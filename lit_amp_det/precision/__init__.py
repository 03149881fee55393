"""Mixed precision for detection: casting helpers, fp32 regions and the Lightning precision plugin.

:func:`force_fp32` / :func:`auto_fp16` mark methods of research modules; they take effect whenever the
plugin (built from ``trainer.precision``) turns mixed precision on for the module, and are no-ops otherwise.
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
    "NonFiniteStepGuard",
    "build_precision_plugin",
    "install_fp32_regions",
]

_CASTING = {"auto_fp16", "cast_tensor_type", "force_fp32", "mixed_precision_dtype", "set_mixed_precision",
            "wrap_method", "unwrap_method"}

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
    from lit_amp_det.precision.plugin import (
        DetectionMixedPrecision,
        FiniteStepPrecision,
        NonFiniteStepGuard,
        build_precision_plugin,
        install_fp32_regions,
    )


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'lit_amp_det.precision' has no attribute {name!r}")
    module = "lit_amp_det.precision.casting" if name in _CASTING else "lit_amp_det.precision.plugin"
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""Mixed precision for detection: casting helpers, fp32 regions and the Lightning precision plugin.

:func:`force_fp32` / :func:`auto_fp16` mark methods of research modules; they take effect whenever the
plugin (built from ``trainer.precision``) turns mixed precision on for the module, and are no-ops otherwise.
"""

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

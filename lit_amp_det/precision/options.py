"""The settings both half-precision plugins take: fp32 regions, the fp16 GradScaler's and the step guard's.

:class:`~lit_amp_det.precision.mixed.DetectionMixedPrecision` and
:class:`~lit_amp_det.precision.low_precision_weights.MasterWeightPrecision` accept these as keywords and build
their GradScaler, fp32-region mapping and :class:`~lit_amp_det.precision.guard.NonFiniteStepGuard` from them
here, so the two plugins cannot drift apart in a default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lit_amp_det.errors import ArgumentError
from lit_amp_det.precision.guard import MAX_CONSECUTIVE_SKIPS, SKIP_CHECK_EVERY_N_STEPS, NonFiniteStepGuard
from lit_amp_det.precision.modes import RegionMode
from lit_amp_det.settings import PrecisionSettings

__all__ = ["GROWTH_INTERVAL", "INIT_SCALE", "HalfPrecisionOptions", "half_dtype"]


def half_dtype(precision: str) -> torch.dtype:
    """The dtype a half-precision ``trainer.precision`` computes in: fp16 for ``16-*``, bf16 for
    ``bf16-*``.
    """
    return torch.float16 if precision.startswith("16-") else torch.bfloat16


#: GradScaler's first loss scale (``precision.init_scale``), torch's default; its home is
#: :class:`~lit_amp_det.settings.PrecisionSettings`
INIT_SCALE: float = PrecisionSettings.init_scale
#: steps without an overflow before GradScaler doubles the scale (``precision.growth_interval``), torch's
#: default (:class:`~lit_amp_det.settings.PrecisionSettings`)
GROWTH_INTERVAL: int = PrecisionSettings.growth_interval


@dataclass(frozen=True)
class HalfPrecisionOptions:
    """What a half-precision plugin is configured with besides its precision and device.

    Args:
        fp32_regions: method paths relative to the LightningModule mapped to ``fp32`` or ``fp32_outputs``
            (:mod:`lit_amp_det.precision.regions`). ``None`` takes the module's ``fp32_regions()``; an empty
            mapping turns regions off (plain autocast).
        init_scale: GradScaler's first loss scale, used by the fp16 precisions only.
        growth_interval: overflow-free steps before GradScaler doubles the scale (fp16 precisions only).
        max_consecutive_skips: the guard stops a fit after this many skipped steps in a row.
        skip_check_every_n_steps: optimizer steps between two host reads of the guard's counts.
    """

    fp32_regions: Mapping[str, RegionMode] | None = None
    init_scale: float = INIT_SCALE
    growth_interval: int = GROWTH_INTERVAL
    max_consecutive_skips: int = MAX_CONSECUTIVE_SKIPS
    skip_check_every_n_steps: int = SKIP_CHECK_EVERY_N_STEPS

    def scaler(self, precision: str, device: str) -> torch.amp.GradScaler | None:
        """A GradScaler for the fp16 precisions (``16-mixed``, ``16-weights``: fp16 gradients underflow
        without one); ``None`` for the bf16 ones.
        """
        if not precision.startswith("16-"):
            return None
        return torch.amp.GradScaler(device, init_scale=self.init_scale, growth_interval=self.growth_interval)

    def regions(self) -> dict[str, RegionMode] | None:
        """A copy of ``fp32_regions`` (``None`` stays ``None``: the module's own regions).

        Raises:
            ArgumentError: ``fp32_regions`` is neither None nor a mapping.
        """
        if self.fp32_regions is None:
            return None
        if not isinstance(self.fp32_regions, Mapping):
            raise ArgumentError(
                "precision.fp32_regions",
                self.fp32_regions,
                "must map method paths to fp32 or fp32_outputs ({} for none), or be null (the module's own)",
            )
        return dict(self.fp32_regions)

    def guard(self, precision: str) -> NonFiniteStepGuard:
        """The non-finite step guard of a plugin running ``precision``, with these settings."""
        return NonFiniteStepGuard(precision, self.max_consecutive_skips, self.skip_check_every_n_steps)

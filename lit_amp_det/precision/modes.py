"""The precision settings' accepted values, in one place (plain constants: the CLI's help reads them too).

``trainer.precision`` values (``auto`` among them), the autocast (``-mixed``) and low-precision-weights
(``-weights``) ones among them, and the modes of an fp32 region. The plugin and the casting helpers check
against these; :mod:`lit_amp_det.app.config` checks a composed config against them before anything is built.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["LOW_PRECISION_WEIGHTS", "MIXED_PRECISIONS", "PRECISIONS", "REGION_MODES", "RegionMode"]

#: ``trainer.precision`` values with autocast (the plugin's ``DetectionMixedPrecision``)
MIXED_PRECISIONS: tuple[str, ...] = ("16-mixed", "bf16-mixed")
#: ``trainer.precision`` values with the weights themselves in fp16/bf16, fp32 masters in the optimizer, norms
#: and fp32 regions in fp32 (the plugin's ``MasterWeightPrecision``). Named apart from Lightning's ``16-true``
#: / ``bf16-true``, which cast everything, norms and optimizer included.
LOW_PRECISION_WEIGHTS: tuple[str, ...] = ("16-weights", "bf16-weights")
#: every ``trainer.precision`` value the package supports; ``auto`` is the device's fast one (``16-mixed`` on
#: CUDA, ``bf16-mixed`` on a CPU with native bf16, else ``32-true``: :mod:`lit_amp_det.precision.hardware`)
PRECISIONS: tuple[str, ...] = ("auto", "32-true", *MIXED_PRECISIONS, *LOW_PRECISION_WEIGHTS)

RegionMode = Literal["fp32", "fp32_outputs"]
#: ``fp32``: inputs cast to fp32 and autocast off inside; ``fp32_outputs``: half outputs cast to fp32
REGION_MODES: tuple[str, ...] = ("fp32", "fp32_outputs")

"""Keeps a CPU run's freed heap mapped between steps, so a step stops paying page faults for the memory the last one
released.

glibc hands large freed blocks back to the OS; a training step that frees and reallocates the same activations every
iteration then faults every page of them in again (see :mod:`lit_amp_det.cpu_heap`, which has the figures). On a
GPU the step's tensors live in CUDA's caching allocator, which keeps freed blocks already, so this callback only acts
when the module runs on the CPU. The cost is memory: the process's resident set stays at the largest heap it has
had, instead of falling between steps, and when a step's large blocks change size from step to step (the R50-FPN's
full-class mask logits scale with the RoI count) the kept heap fragments and keeps growing: 200 R50 training steps
on changing batches grew the resident set by 1.9 GB retained against 1.0 GB with glibc's default, by 1.0 GB with
``model.labelled_mask_logits`` and by 0.5 GB (flat after 40 steps) with the Winograd row's switches; the light model's
is flat either way (BENCHMARKS.md, "Memory over a long run").
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lit_amp_det.cpu_heap import retain_freed_memory, return_freed_memory

__all__ = ["RetainCPUHeap"]


class RetainCPUHeap(Callback):
    """Makes glibc keep freed memory for reuse while a CPU fit, validation, test or predict runs
    (:func:`lit_amp_det.cpu_heap.retain_freed_memory`); ``teardown`` restores glibc's behaviour.

    Does nothing on other devices, and warns once and does nothing where glibc's ``mallopt`` is missing (macOS,
    musl). The policy is process-wide: DataLoader workers forked after it applies inherit it.
    """

    def __init__(self) -> None:
        self.applied = False
        self._unavailable = False

    def _apply(self, pl_module: pl.LightningModule) -> None:
        if self.applied or self._unavailable or pl_module.device.type != "cpu":
            return
        self.applied = retain_freed_memory()
        self._unavailable = not self.applied
        if self._unavailable:
            rank_zero_warn("RetainCPUHeap: glibc's mallopt is not available here, so the heap policy is unchanged; "
                           "remove the callback (callbacks.retain_cpu_heap=null) to silence this")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(pl_module)

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(pl_module)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._apply(pl_module)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.applied:
            return_freed_memory()
            self.applied = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

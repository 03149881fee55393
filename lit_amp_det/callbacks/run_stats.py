"""Records a fit's training speed and peak memory for ``metrics.json`` (and so for sweep summaries).

Every ``fit`` gets this callback whatever the ``callbacks`` group holds, so runs of a sweep that toggles
callbacks are measured the same way. It logs and prints nothing: ``train`` writes its totals under ``perf`` in
``metrics.json``. Steps are timed like :class:`~lit_amp_det.callbacks.throughput.Throughput`; memory is the
largest per-step peak, so one-off work before training does not count. A CPU resident set also holds what
earlier jobs of a sweep left behind; ``tensor_memory_mb`` does not: it adds up parameters, gradients,
optimizer state and what autograd saved for backward, once, on the first timed step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from typing_extensions import override

from lit_amp_det.profiling import MemoryProbe, SavedTensorBytes, count_images, release_freed_cpu_memory

__all__ = ["RunStats", "resident_training_bytes"]


class RunStats(Callback):
    """Training images/s, median step time and peak memory of a fit (see :meth:`summary`).

    Args:
        warmup_steps: steps at the start of the fit that are not timed or measured.
    """

    def __init__(self, warmup_steps: int = 2) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"RunStats warmup_steps={warmup_steps!r} must be an integer >= 0")
        self.warmup_steps = warmup_steps
        self._probe: MemoryProbe | None = None
        self._steps_seen = 0
        self._started: float | None = None
        self._step_seconds: list[float] = []
        self._images = self._peak_bytes = self._step_bytes = 0
        self._in_use_at_start: int | None = None
        self._world_size = 1
        self._saved: SavedTensorBytes | None = None
        self._tensor_bytes: int | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._probe, self._world_size = MemoryProbe(trainer.strategy.root_device), trainer.world_size
        self._steps_seen, self._started, self._step_seconds, self._images = 0, None, [], 0
        self._peak_bytes, self._step_bytes, self._tensor_bytes = 0, 0, None
        if not self._probe.cuda:
            # jobs of a sweep share the process: hand what earlier jobs freed back to the OS, or their
            # leftovers count in this job's resident-set peak (and the figure would rank settings by job
            # order)
            release_freed_cpu_memory()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._started = None
        if self._probe is not None and self._steps_seen >= self.warmup_steps:
            self._probe.synchronize()
            self._probe.reset_peak()
            self._in_use_at_start = self._probe.in_use_bytes()
            if self._tensor_bytes is None:  # the first timed step also counts its tensors
                self._saved = SavedTensorBytes(
                    exclude=[*pl_module.parameters(), *pl_module.buffers()]
                ).__enter__()
            self._started = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._steps_seen += 1
        if self._started is None or self._probe is None:
            return
        self._probe.synchronize()
        self._step_seconds.append(time.perf_counter() - self._started)
        self._started = None
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
            self._tensor_bytes = self._saved.bytes + resident_training_bytes(pl_module, trainer.optimizers)
            self._saved = None
        self._images += count_images(batch)
        peak = self._probe.peak_bytes()
        self._peak_bytes = max(self._peak_bytes, peak)
        if self._in_use_at_start is not None:
            self._step_bytes = max(self._step_bytes, peak - self._in_use_at_start)

    def summary(self) -> dict[str, Any]:
        """``device``, ``world_size``, ``timed_steps``, ``train_images_per_s``, ``train_step_ms_median``,
        ``peak_memory_mb``, ``step_memory_mb``, ``memory_source``.

        ``peak_memory_mb`` is the largest step peak: the allocator's on a GPU, the whole process's resident
        set on a CPU (libraries and data included, so on a CPU it moves little between settings).
        ``step_memory_mb`` is what a step added on top of what was in use when it started (activations,
        gradients, optimizer state growth): the figure that shows what mixed precision and conv-bn eval save.
        ``tensor_memory_mb`` is parameters + gradients + optimizer state + the activations saved for backward
        of the first timed step: independent of what ran before in the process, so a sweep's jobs compare in
        any order.

        Speed and memory are ``None`` when no step was timed (a fit shorter than the warm-up). Under DDP,
        images/s counts every process (this rank's rate times the world size: ranks step in lockstep) and the
        peak memory is this process's (rank 0 writes ``metrics.json``).
        """
        timed, probe = len(self._step_seconds), self._probe
        return {
            "device": None if probe is None else str(probe.device),
            "world_size": self._world_size,
            "timed_steps": timed,
            "train_images_per_s": self._world_size * self._images / sum(self._step_seconds)
            if timed
            else None,
            "train_step_ms_median": 1000.0 * statistics.median(self._step_seconds) if timed else None,
            "peak_memory_mb": self._peak_bytes / 2**20 if timed else None,
            "step_memory_mb": self._step_bytes / 2**20 if timed else None,
            "tensor_memory_mb": None if self._tensor_bytes is None else self._tensor_bytes / 2**20,
            "memory_source": None if probe is None else probe.source,
        }


def resident_training_bytes(module: pl.LightningModule, optimizers: list[Any]) -> int:
    """Bytes of the parameters, their gradients and the optimizers' state tensors (each storage once).

    The optimizers' own parameters count too: under ``trainer.precision=bf16-weights|16-weights`` they are the
    fp32 masters (and their gradients), which the model's ``parameters()`` do not list.
    """
    seen: set[int] = set()
    total = 0

    def add(tensor: Any) -> None:
        nonlocal total
        if isinstance(tensor, torch.Tensor) and tensor.layout == torch.strided:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()

    for parameter in module.parameters():
        add(parameter)
        add(parameter.grad)
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                add(parameter)
                add(parameter.grad)
        for state in optimizer.state.values():
            for value in state.values():
                add(value)
    return total

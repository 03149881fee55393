"""The whole training step (forward, loss, backward, loss scaling, optimizer step, the non-finite guard) replayed as one
CUDA graph, as NVIDIA's MLPerf Mask R-CNN runs it.

With :class:`CUDAGraphTraining` in the callbacks, :class:`~lit_amp_det.MaskRCNNModule` optimises manually: each batch is
copied into static input buffers (one set per batch signature, up to ``max_graphs``); a signature's first
``warmup_steps`` batches train eagerly on them (on a side stream, the last one counted for host syncs), then the step
is captured and each later batch is one ``graph.replay()``: no Python, no launches, no host sync. The lr becomes a
device tensor the schedule fills in place. The graph replays what the step did at capture, so the start refuses, with
what to change, what it could not hold: changing shapes, a host sync (by file and line), an optimizer reading its lr on
the host, hooks inside the step, clipping, accumulation, other precisions, several processes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from torch import Tensor
from typing_extensions import override

from lit_amp_det.errors import ArgumentError
from lit_amp_det.precision._lightning_internals import carry_step_count, count_manual_step
from lit_amp_det.precision.skip import gradients, non_finite
from lit_amp_det.profiling import HostSyncs

__all__ = ["CUDAGraphTraining", "capture_graph"]

Step = Callable[[], tuple[dict[str, Tensor], Tensor]]
_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


def capture_graph(step: Step) -> Step:
    """``step`` captured in a CUDA graph (in its own memory pool); returns ``replay`` -> the static outputs."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()

    def replay() -> tuple[dict[str, Tensor], Tensor]:
        graph.replay()
        return outputs
    return replay


def _signature(images: Sequence[Tensor], targets: Sequence[dict[str, Any]]) -> tuple[Any, ...]:
    """Shapes and dtypes of a batch's tensors: batches with one signature share static buffers and a graph."""
    return (tuple((tuple(i.shape), i.dtype) for i in images),
            tuple(tuple((k, tuple(v.shape), v.dtype) for k, v in t.items() if isinstance(v, Tensor)) for t in targets))


def _tensors(images: Sequence[Tensor], targets: Sequence[dict[str, Any]]) -> list[Tensor]:
    return [*images, *(v for t in targets for v in t.values() if isinstance(v, Tensor))]


class _Entry:
    """One batch signature: its static buffers, eager steps taken so far and, once captured, the replay."""

    def __init__(self, images: list[Tensor], targets: list[dict[str, Any]]) -> None:
        self.images, self.targets, self.steps = images, targets, 0
        self.replay: Step | None = None


class CUDAGraphTraining(Callback):
    """Trains with the whole step in one CUDA graph per batch signature (see the module).

    Args:
        warmup_steps: eager steps on a signature's buffers before its capture (kernel autotuning, cuBLAS workspaces,
            optimizer state and the fused kernels' first-step paths happen there).
        max_graphs: batch signatures (and graphs, each with its own memory) allowed; one more stops training."""

    #: Device types the capture runs on (tests add ``cpu`` with an eager stand-in for :func:`capture_graph`).
    device_types: tuple[str, ...] = ("cuda",)

    def __init__(self, warmup_steps: int = 3, max_graphs: int = 3) -> None:
        if warmup_steps < 2:
            raise ArgumentError("warmup_steps", warmup_steps, "must be >= 2 (an optimizer's first step creates its "
                                "state and may read the device; the step before the capture must not)")
        if max_graphs < 1:
            raise ArgumentError("max_graphs", max_graphs, "must be >= 1")
        self.warmup_steps, self.max_graphs = warmup_steps, max_graphs
        self._entries: dict[tuple[Any, ...], _Entry] = {}

    # ------------------------------------------------------------------------------ what the graph cannot hold
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After ``configure_model`` (the speedups) and the precision plugin's setup: refuses, or takes the step."""
        if refuse := self._refusal(trainer, pl_module, trainer.strategy.root_device):
            raise RuntimeError(f"callbacks.cuda_graph cannot capture this training step: {refuse}")
        self._entries = {}
        pl_module.automatic_optimization = False
        pl_module.captured_step = self

    def _refusal(self, trainer: pl.Trainer, module: pl.LightningModule, device: torch.device) -> str | None:
        if device.type not in self.device_types:
            return f"it runs on {device.type}; CUDA graphs need trainer.accelerator=gpu"
        if trainer.world_size > 1:
            return f"{trainer.world_size} processes; it captures a single-process step (DDP's buckets are not captured)"
        step_owner = next(c for c in type(module).__mro__ if "training_step" in vars(c))
        if not hasattr(module, "captured_step") or step_owner.__module__ != "lit_amp_det.module":
            return f"{type(module).__name__} is not a MaskRCNNModule with its training_step"
        if trainer.gradient_clip_val or trainer.accumulate_grad_batches != 1:
            return "trainer.gradient_clip_val and trainer.accumulate_grad_batches are not captured: unset them"
        hooks = [f"{type(owner).__name__}.{hook}" for owner in (module, *trainer.callbacks) for hook in _STEP_HOOKS
                 if getattr(type(owner), hook, None) not in (None, getattr(pl.LightningModule, hook, None),
                                                              getattr(Callback, hook, None))]
        if hooks:
            return f"{', '.join(hooks)} would run once, at capture, and never again"
        if not hasattr(getattr(module, "model", None), "forward_padded"):
            return ("its shapes change from step to step: apply speedups.sync_free on cuda "
                    "(speedups.sync_free.devices=[cuda]) and pad the targets (data.pad_instances=100)")
        scales = getattr(getattr(module.model, "transform", None), "min_size", ())
        if len(scales) > 1:
            return f"model.transform.min_size={list(scales)} draws a scale per batch; give one size"
        plugin = trainer.precision_plugin
        if not hasattr(plugin, "guard") or trainer.precision not in ("32-true", "bf16-mixed", "16-mixed"):
            return f"trainer.precision={trainer.precision}; it captures 32-true, bf16-mixed and 16-mixed"
        return None

    def _optimizer_refusal(self, trainer: pl.Trainer) -> str | None:
        if len(trainer.optimizers) != 1:
            return f"{len(trainer.optimizers)} optimizers; it captures one"
        groups = trainer.optimizers[0].param_groups
        if not all(group.get("fused") or group.get("capturable") for group in groups):
            return ("the optimizer reads its lr on the host each step: build it fused (optim.optimizer.fused=auto) "
                    "or capturable=True")
        if any(config.reduce_on_plateau for config in trainer.lr_scheduler_configs):
            return "ReduceLROnPlateau reads a metric on the host; use a schedule by step or epoch"
        return None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After the optimizer is built and a checkpoint restored: lrs become device tensors (the schedule fills them
        in place), and the step count carries over from a run that optimised automatically."""
        if refuse := self._optimizer_refusal(trainer):
            raise RuntimeError(f"callbacks.cuda_graph cannot capture this training step: {refuse}")
        for group in trainer.optimizers[0].param_groups:
            if not isinstance(group["lr"], Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), device=trainer.strategy.root_device)
        carry_step_count(trainer, to_manual=True)

    # ------------------------------------------------------------------------------ the step
    def feed(self, images: Sequence[Tensor], targets: Sequence[dict[str, Any]],
             device: torch.device) -> tuple[list[Tensor], list[dict[str, Any]]]:
        """The static buffers of this batch's signature, refilled in place with this batch (a new signature gets new
        buffers, on ``device``)."""
        key = _signature(images, targets)
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self.max_graphs:
                shapes = sorted({tuple(i.shape) for i in images})
                raise RuntimeError(f"callbacks.cuda_graph: a batch of a new shape signature (images {shapes}) after "
                                   f"{len(self._entries)} captured (callbacks.cuda_graph.max_graphs={self.max_graphs})"
                                   ". Feed images of fixed sizes and pad the targets (data.pad_instances), or raise "
                                   "max_graphs (each graph keeps its own activations)")
            moved = [i.to(device, copy=True) for i in images]
            entry = self._entries[key] = _Entry(moved, [{k: v.to(device, copy=True) if isinstance(v, Tensor) else v
                                                         for k, v in t.items()} for t in targets])
        else:
            for buffer, value in zip(_tensors(entry.images, entry.targets), _tensors(images, targets)):
                if buffer is not value:
                    buffer.copy_(value, non_blocking=True)
        return entry.images, entry.targets

    def run(self, module: Any, images: Sequence[Tensor],
            targets: Sequence[dict[str, Tensor]]) -> tuple[dict[str, Tensor], Tensor]:
        """One training step on ``images``/``targets`` (copied into their signature's static buffers): eager during
        warm-up, a replay after; returns the losses (copies, safe to keep)."""
        if "valid" not in (targets[0] if targets else {}):
            raise RuntimeError("callbacks.cuda_graph: the training targets are not padded; set data.pad_instances "
                               "(e.g. 100) so that every batch has the same shapes")
        static_images, static_targets = self.feed(images, targets, images[0].device)
        entry = self._entries[_signature(static_images, static_targets)]
        if entry.replay is None:
            step = self._step_function(module, static_images, module.training_targets(static_targets))
            loss_dict, loss = self._eager(step, static_images[0].device, entry.steps == self.warmup_steps - 1)
            entry.steps += 1
            if entry.steps == self.warmup_steps:  # the capture records the step without running it
                entry.replay = capture_graph(step)
        else:
            loss_dict, loss = entry.replay()
        # then what the loop does after an automatic optimizer step: step count, the guard's host check, schedules
        trainer = module.trainer
        count_manual_step(trainer)
        trainer.precision_plugin.guard.tick()
        trainer.precision_plugin.guard.log(module)
        for config in trainer.lr_scheduler_configs:
            if config.interval == "step" and trainer.global_step % config.frequency == 0:
                config.scheduler.step()
        return {k: v.clone() for k, v in loss_dict.items()}, loss.clone()

    def _eager(self, step: Step, device: torch.device, count_syncs: bool) -> tuple[dict[str, Tensor], Tensor]:
        """A warm-up step, on a side stream as capture requires; the one before the capture counts host syncs."""
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        counter = HostSyncs() if count_syncs else contextlib.nullcontext()
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext(), counter:
            outputs = step()
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        if isinstance(counter, HostSyncs) and counter.total:
            raise RuntimeError("callbacks.cuda_graph: the training step makes the host wait for the device "
                               f"{counter.total} time(s), which a CUDA graph cannot hold:\n{counter.table()}\n"
                               "Remove the read at these sites (the step must be speedups.sync_free's)")
        return outputs

    def _step_function(self, module: Any, images: list[Tensor], targets: list[dict[str, Tensor]]) -> Step:
        """Forward and loss under the precision's autocast (its cast cache off, as capture requires), backward,
        then the optimizer step as the precision plugin takes it (GradScaler or the non-finite guard), on device."""
        plugin, optimizer = module.trainer.precision_plugin, module.trainer.optimizers[0]
        scaler, low = getattr(plugin, "scaler", None), getattr(plugin, "low_dtype", None)
        device_type = images[0].device.type

        def step() -> tuple[dict[str, Tensor], Tensor]:
            optimizer.zero_grad(set_to_none=False)  # gradients stay in their buffers: the graph zeroes and refills
            with (torch.autocast(device_type, dtype=low, cache_enabled=False) if low is not None
                  else contextlib.nullcontext()):
                loss_dict = module.model(module.prepare_images(images), targets)
                loss = module.compute_loss(loss_dict)
            # Lightning runs the training step under the precision's autocast; backward and step run outside it
            with torch.autocast(device_type, enabled=False):
                if scaler is None:
                    loss.backward()
                    plugin.guard.step(optimizer, tick=False)
                else:
                    scaler.scale(loss).backward()
                    found = non_finite(gradients(optimizer))  # what GradScaler finds, for the guard's count
                    scaler.step(optimizer)
                    scaler.update()
                    plugin.guard.record(found, tick=False)
            return {k: v.detach() for k, v in loss_dict.items()}, loss.detach()
        return step

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for config in trainer.lr_scheduler_configs:
            if config.interval == "epoch" and (trainer.current_epoch + 1) % config.frequency == 0:
                config.scheduler.step()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and getattr(pl_module, "captured_step", None) is self:
            pl_module.captured_step = None
            carry_step_count(trainer, to_manual=False)
            pl_module.automatic_optimization = True
            self._entries = {}

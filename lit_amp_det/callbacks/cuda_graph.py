"""The whole training step (forward, loss, backward, loss scaling, optimizer step, the non-finite guard)
replayed as one CUDA graph, as NVIDIA's MLPerf Mask R-CNN runs it.

With :class:`CUDAGraphTraining` in the callbacks, :class:`~lit_amp_det.MaskRCNNModule` optimises manually:
each batch is copied into static input buffers (one set per batch signature, up to ``max_graphs``); a
signature's first ``warmup_steps`` batches train eagerly on them (on a side stream, the last one counted for
host syncs), then the step is captured and each later batch is one ``graph.replay()``: no Python, no launches,
no host sync. The lr becomes a device tensor the schedule fills in place, and an optimizer with PyTorch's
``capturable`` mode (Adam, AdamW) gets it, so that the configured optimizer is captured as built; both go back
as they were at the end of training and in every checkpoint, which therefore resumes into any optimizer and
without the callback. The warm-up steps and the captures run on one side stream, and the graphs share one
memory pool. The graph replays what the step did at capture, so the start refuses, with what to change, what
it could not hold: changing shapes, a host sync (by file and line), an optimizer reading its lr on the host,
hooks inside the step, clipping, accumulation, other precisions, several processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from torch import Tensor
from typing_extensions import override

from lit_amp_det.errors import ArgumentError
from lit_amp_det.models.sync_free import is_fixed_shape
from lit_amp_det.module import MaskRCNNModule
from lit_amp_det.precision._lightning_internals import carry_step_count, count_manual_step
from lit_amp_det.precision.plugin import DetectionPrecision, detection_precision
from lit_amp_det.precision.skip import gradients, non_finite
from lit_amp_det.profiling import HostSyncs

__all__ = [
    "CUDAGraphTraining",
    "CapturableFlags",
    "as_configured",
    "capture_graph",
    "capture_refusal",
    "make_capturable",
    "restore_configuration",
]

Step = Callable[[], tuple[dict[str, Tensor], Tensor]]
#: the precisions whose step it captures
_CAPTURED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
_STEP_HOOKS = ("on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


def capture_graph(
    step: Step,
    pool: tuple[int, int] | None = None,
    stream: torch.cuda.Stream | None = None,
) -> Step:
    """Captures ``step`` in a CUDA graph: the capture records the step's kernels without running them.

    Args:
        step: the training step, returning ``(loss_dict, loss)``. pool: a memory pool handle
        (:func:`torch.cuda.graph_pool_handle`) that the graph shares with other graphs;
            ``None``: a pool of its own.
        stream: the side stream the capture runs on; ``None``: PyTorch's capture stream.

    Returns:
        ``replay``: runs the graph and returns the step's static outputs, which the next replay of any graph
        sharing the pool may overwrite.
    """
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        outputs = step()

    def replay() -> tuple[dict[str, Tensor], Tensor]:
        graph.replay()
        return outputs

    return replay


class CapturableFlags(NamedTuple):
    """An optimizer's ``capturable`` flags as it was built (``None`` where it has no such flag): in
    ``defaults`` and in each param group. :func:`restore_configuration` and :func:`as_configured` put them
    back.
    """

    default: bool | None
    groups: tuple[bool | None, ...]


def capture_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s step cannot be replayed from a CUDA graph with an lr that changes, or ``None`` when
    it can.

    A captured step must read its lr and step counts on the device. Optimizers with PyTorch's ``capturable``
    mode do once :func:`make_capturable` sets it; fused optimizers without the flag (SGD) read a tensor lr in
    their kernel. Anything else reads the lr on the host: SGD's foreach and for-loop steps call ``.item()`` on
    it.

    Args:
        optimizer: the optimizer the training step steps.

    Returns:
        The reason, with what to change, or ``None``.
    """
    if "capturable" in optimizer.defaults or all(group.get("fused") for group in optimizer.param_groups):
        return None
    name = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
    return (
        f"{name} has no capturable mode in torch {torch.__version__} and is not fused, so its step reads the "
        "lr on the host: build it fused (optim.optimizer.fused=auto, the default, or true), or use an "
        "optimizer with a capturable mode (torch.optim.AdamW, torch.optim.Adam)"
    )


def make_capturable(optimizer: torch.optim.Optimizer) -> CapturableFlags:
    """Sets PyTorch's ``capturable`` flag in ``defaults`` and in every param group of an optimizer that has
    one, and puts its step counts on their parameters' devices, as ``torch.optim`` keeps them for a capturable
    step.

    Done before the first step that will be captured; the state may already exist (warm-up steps, a
    checkpoint). A fused optimizer already keeps its step counts on the device; a foreach one keeps them on
    the CPU otherwise.

    Args:
        optimizer: the optimizer to make capturable (``capture_refusal(optimizer)`` is ``None``).

    Returns:
        The flags it had, for :func:`restore_configuration` and :func:`as_configured`.
    """
    flags = CapturableFlags(
        optimizer.defaults.get("capturable"),
        tuple(group.get("capturable") for group in optimizer.param_groups),
    )
    if flags.default is not None:
        optimizer.defaults["capturable"] = True
        for group in optimizer.param_groups:
            group["capturable"] = True
    _place_step_counts(optimizer)
    return flags


def restore_configuration(optimizer: torch.optim.Optimizer, flags: CapturableFlags) -> None:
    """Gives ``optimizer`` back as it was built: lrs as Python floats, the ``capturable`` flags it had, and
    its step counts where ``torch.optim`` keeps them for those flags.

    Args:
        optimizer: an optimizer :func:`make_capturable` changed, its lrs possibly device tensors.
        flags: what :func:`make_capturable` returned.
    """
    if flags.default is not None:
        optimizer.defaults["capturable"] = flags.default
    for group, flag in zip(optimizer.param_groups, flags.groups):
        _as_built(group, flag)
    _place_step_counts(optimizer)


def as_configured(saved: dict[str, Any], flags: CapturableFlags) -> dict[str, Any]:
    """A copy of an optimizer's ``state_dict()`` that describes the optimizer as it was built: lrs as Python
    floats, the ``capturable`` flags it had, and step counts on the CPU where a group is neither capturable
    nor fused.

    ``load_state_dict`` takes every hyperparameter from the saved groups, so a device lr or a ``capturable``
    flag saved while the callback trains would follow the checkpoint into a resumed run: a foreach AdamW
    refuses a tensor lr unless capturable, and a capturable one refuses CPU parameters.

    Args:
        saved: ``optimizer.state_dict()`` while the callback trains (it is not changed).
        flags: what :func:`make_capturable` returned.

    Returns:
        The new state dict (tensors it does not change are shared with ``saved``).
    """
    groups = [_as_built(dict(group), flag) for group, flag in zip(saved["param_groups"], flags.groups)]
    state = dict(saved["state"])
    for group in groups:
        if group.get("capturable") or group.get("fused"):
            continue
        for index in group["params"]:
            entry = state.get(index, {})
            if isinstance(entry.get("step"), Tensor):
                state[index] = {**entry, "step": entry["step"].cpu()}
    return {**saved, "state": state, "param_groups": groups}


def _as_built(group: dict[str, Any], capturable: bool | None) -> dict[str, Any]:
    """``group`` (a param group, changed in place and returned) as the optimizer was built: its lr a Python
    float and its ``capturable`` flag the one it had (``None``: the optimizer has no such flag).
    """
    if capturable is not None:
        group["capturable"] = capturable
    if isinstance(group["lr"], Tensor):
        group["lr"] = float(group["lr"])
    return group


def _place_step_counts(optimizer: torch.optim.Optimizer) -> None:
    """Puts each ``step`` count where ``torch.optim`` keeps it: on its parameter's device when the group is
    capturable or fused (the kernels read it there), on the CPU otherwise (the step reads it on the host).
    """
    for group in optimizer.param_groups:
        on_device = bool(group.get("capturable") or group.get("fused"))
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            step = state.get("step")
            if isinstance(step, Tensor):
                state["step"] = step.to(param.device if on_device else "cpu")


def _scheduler_as_configured(saved: dict[str, Any]) -> dict[str, Any]:
    """A copy of an lr scheduler's ``state_dict()`` with the last lrs as floats (they are the device lrs'
    copies).
    """
    if "_last_lr" not in saved:
        return saved
    last = [float(lr) if isinstance(lr, Tensor) else lr for lr in saved["_last_lr"]]
    return {**saved, "_last_lr": last}


@contextlib.contextmanager
def _syncs_raise(device: torch.device) -> Iterator[None]:
    """On CUDA, makes every op that synchronises with the device raise (``torch.cuda.set_sync_debug_mode``):
    the driver's own check, beside :class:`~lit_amp_det.profiling.HostSyncs`' count, for what the count cannot
    see.
    """
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _is_sync_error(error: RuntimeError) -> bool:
    """Whether ``error`` is the one ``set_sync_debug_mode("error")`` raises."""
    return "synchronizing CUDA operation" in str(error)


def _signature(images: Sequence[Tensor], targets: Sequence[dict[str, Any]]) -> tuple[Any, ...]:
    """Shapes and dtypes of a batch's tensors: batches with one signature share static buffers and a graph."""
    return (
        tuple((tuple(i.shape), i.dtype) for i in images),
        tuple(
            tuple((k, tuple(v.shape), v.dtype) for k, v in t.items() if isinstance(v, Tensor))
            for t in targets
        ),
    )


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
        warmup_steps: eager steps on a signature's buffers before its capture (kernel autotuning, cuBLAS
        workspaces,
            optimizer state and the fused kernels' first-step paths happen there).
        max_graphs: batch signatures (and graphs, sharing one memory pool) allowed; one more stops training.
    """

    #: Device types the capture runs on (tests add ``cpu`` with an eager stand-in for :func:`capture_graph`).
    device_types: tuple[str, ...] = ("cuda",)

    def __init__(self, warmup_steps: int = 3, max_graphs: int = 3) -> None:
        if warmup_steps < 2:
            raise ArgumentError(
                "warmup_steps",
                warmup_steps,
                "must be >= 2 (an optimizer's first step creates its "
                "state and may read the device; the step before the capture must not)",
            )
        if max_graphs < 1:
            raise ArgumentError("max_graphs", max_graphs, "must be >= 1")
        self.warmup_steps = warmup_steps
        self.max_graphs = max_graphs
        self._entries: dict[tuple[Any, ...], _Entry] = {}
        self._flags: CapturableFlags | None = None  # the optimizer's flags as built, while it is capturable
        self._stream: torch.cuda.Stream | None = (
            None  # the one side stream of the warm-up steps and the captures
        )
        self._pool: tuple[int, int] | None = None  # the memory pool the graphs share
        self._precision: DetectionPrecision | None = None  # the precision plugin, from fit start to teardown

    # ------------------------------------------------------------------------------ what the graph cannot
    # hold
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After ``configure_model`` (the speedups), the precision plugin's setup and
        ``configure_optimizers``: refuses, or takes the step.
        """
        precision = detection_precision(trainer)
        refuse = self._refusal(trainer, pl_module, precision) or self._optimizer_refusal(trainer, precision)
        # a module of another class and another precision plugin are refused too; named for the type checker
        if refuse or precision is None or not isinstance(pl_module, MaskRCNNModule):
            raise RuntimeError(f"callbacks.cuda_graph cannot capture this training step: {refuse}")
        self._entries = {}
        self._precision = precision
        pl_module.set_captured_step(self)

    def _refusal(
        self,
        trainer: pl.Trainer,
        module: pl.LightningModule,
        precision: DetectionPrecision | None,
    ) -> str | None:
        device = trainer.strategy.root_device
        if device.type not in self.device_types:
            return f"it runs on {device.type}; CUDA graphs need trainer.accelerator=gpu"
        if trainer.world_size > 1:
            return (
                f"{trainer.world_size} processes; it captures a single-process step "
                "(DDP's buckets are not captured)"
            )
        if not isinstance(module, MaskRCNNModule):
            return (
                f"{type(module).__name__} is not a MaskRCNNModule, whose training_step runs the captured step"
            )
        if type(module).training_step is not MaskRCNNModule.training_step:
            return (
                f"{type(module).__name__} overrides MaskRCNNModule.training_step, which runs the captured "
                "step: customise compute_loss or build_model instead"
            )
        if trainer.gradient_clip_val or trainer.accumulate_grad_batches != 1:
            return (
                "trainer.gradient_clip_val and trainer.accumulate_grad_batches are not captured: unset them"
            )
        hooks = [
            f"{type(owner).__name__}.{hook}"
            for owner in (module, *trainer.callbacks)
            for hook in _STEP_HOOKS
            if getattr(type(owner), hook, None)
            not in (None, getattr(pl.LightningModule, hook, None), getattr(Callback, hook, None))
        ]
        if hooks:
            return f"{', '.join(hooks)} would run once, at capture, and never again"
        if not is_fixed_shape(module.model):
            return (
                "its shapes change from step to step: apply speedups.sync_free on cuda "
                "(speedups.sync_free.devices=[cuda]) and pad the targets "
                "(speedups.sync_free.instances_per_image=100)"
            )
        scales = getattr(getattr(module.model, "transform", None), "min_size", ())
        if len(scales) > 1:
            return f"model.transform.min_size={list(scales)} draws a scale per batch; give one size"
        if precision is None:
            return (
                f"the Trainer's precision plugin is {type(trainer.precision_plugin).__name__}; it captures "
                "the steps of lit_amp_det's plugins (pass trainer.precision instead of a plugin)"
            )
        if trainer.precision not in _CAPTURED_PRECISIONS:
            return f"trainer.precision={trainer.precision}; it captures {', '.join(_CAPTURED_PRECISIONS)}"
        return None

    def _optimizer_refusal(self, trainer: pl.Trainer, precision: DetectionPrecision | None) -> str | None:
        if len(trainer.optimizers) != 1:
            return f"{len(trainer.optimizers)} optimizers; it captures one"
        optimizer = trainer.optimizers[0]
        if refuse := capture_refusal(optimizer):
            return refuse
        scaled = precision is not None and precision.scaler is not None
        if scaled and not getattr(optimizer, "_step_supports_amp_scaling", False):
            return (
                f"trainer.precision={trainer.precision} with an unfused {type(optimizer).__name__}: "
                "GradScaler reads whether its gradients were finite on the host before stepping it; "
                "build it fused (optim.optimizer.fused=auto, the default, or true)"
            )
        if any(config.reduce_on_plateau for config in trainer.lr_scheduler_configs):
            return "ReduceLROnPlateau reads a metric on the host; use a schedule by step or epoch"
        return None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After the optimizer is built and a checkpoint restored, before the first step: the optimizer
        becomes capturable (:func:`make_capturable`), its lrs device tensors (the schedule fills them in
        place), and the step count carries over from a run that optimised automatically.
        """
        optimizer = trainer.optimizers[0]
        self._flags = make_capturable(optimizer)
        for group in optimizer.param_groups:
            if not isinstance(group["lr"], Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), device=trainer.strategy.root_device)
        carry_step_count(trainer, to_manual=True)

    @override
    def on_save_checkpoint(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        checkpoint: dict[str, Any],
    ) -> None:
        """The checkpoint describes the optimizer and its schedule as built (:func:`as_configured`), not as
        this callback runs them, so that it resumes into any optimizer, with the callback or without.
        """
        if self._flags is None:
            return
        optimizers = checkpoint.get("optimizer_states")
        if optimizers:
            checkpoint["optimizer_states"] = [as_configured(optimizers[0], self._flags), *optimizers[1:]]
        schedulers = checkpoint.get("lr_schedulers")
        if schedulers:
            checkpoint["lr_schedulers"] = [_scheduler_as_configured(saved) for saved in schedulers]

    # ------------------------------------------------------------------------------ the step
    def feed(
        self, images: Sequence[Tensor], targets: Sequence[dict[str, Any]], device: torch.device
    ) -> tuple[list[Tensor], list[dict[str, Any]]]:
        """The static buffers of this batch's signature, refilled in place with this batch (a new signature
        gets new buffers, on ``device``).
        """
        key = _signature(images, targets)
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= self.max_graphs:
                shapes = sorted({tuple(i.shape) for i in images})
                raise RuntimeError(
                    f"callbacks.cuda_graph: a batch of a new shape signature (images {shapes}) after "
                    f"{len(self._entries)} captured (callbacks.cuda_graph.max_graphs={self.max_graphs})"
                    ". Feed images of fixed sizes and pad the targets "
                    "(speedups.sync_free.instances_per_image), or raise "
                    "max_graphs (each graph adds its memory to the pool the graphs share)"
                )
            moved = [i.to(device, copy=True) for i in images]
            entry = self._entries[key] = _Entry(
                moved,
                [
                    {k: v.to(device, copy=True) if isinstance(v, Tensor) else v for k, v in t.items()}
                    for t in targets
                ],
            )
        else:
            for buffer, value in zip(_tensors(entry.images, entry.targets), _tensors(images, targets)):
                if buffer is not value:
                    buffer.copy_(value, non_blocking=True)
        return entry.images, entry.targets

    def run(
        self,
        module: MaskRCNNModule,
        images: Sequence[Tensor],
        targets: Sequence[dict[str, Tensor]],
    ) -> tuple[dict[str, Tensor], Tensor]:
        """One training step on ``images``/``targets`` (copied into their signature's static buffers): eager
        during warm-up, a replay after (:class:`~lit_amp_det.module.CapturedStep`).

        Args:
            module: the module that trains (it calls this from its ``training_step``).
            images: the batch's ``[3, H, W]`` images.
            targets: the batch's targets, padded (``data.pad_instances``).

        Returns:
            ``(loss_dict, loss)``: copies of the step's losses, safe to keep.

        Raises:
            RuntimeError: for unpadded targets, or outside a fit this callback started.
        """
        guard = self._running_precision().guard
        if "valid" not in (targets[0] if targets else {}):
            raise RuntimeError(
                "callbacks.cuda_graph: the training targets are not padded; set data.pad_instances or "
                "speedups.sync_free.instances_per_image (e.g. speedups.sync_free.instances_per_image=100) "
                "so that every batch has the same shapes"
            )
        static_images, static_targets = self.feed(images, targets, images[0].device)
        entry = self._entries[_signature(static_images, static_targets)]
        if entry.replay is None:
            step = self._step_function(module, static_images, module.training_targets(static_targets))
            loss_dict, loss = self._eager(step, static_images[0].device, entry.steps == self.warmup_steps - 1)
            entry.steps += 1
            if entry.steps == self.warmup_steps:  # the capture records the step without running it
                entry.replay = self._capture(step, static_images[0].device)
        else:
            loss_dict, loss = entry.replay()
        # then what the loop does after an automatic optimizer step: step count, the guard's host check,
        # schedules
        trainer = module.trainer
        count_manual_step(trainer)
        # the automatic count too: a checkpoint written now then resumes at this step without the callback as
        # well
        carry_step_count(trainer, to_manual=False)
        guard.tick()
        guard.log(module)
        for config in trainer.lr_scheduler_configs:
            if config.interval == "step" and trainer.global_step % config.frequency == 0:
                config.scheduler.step()
        return {k: v.clone() for k, v in loss_dict.items()}, loss.clone()

    def _running_precision(self) -> DetectionPrecision:
        """The precision plugin of the fit that :meth:`on_fit_start` accepted."""
        if self._precision is None:
            raise RuntimeError(
                "callbacks.cuda_graph: run() trains a step of a fit it started (MaskRCNNModule.training_step "
                "calls it between on_fit_start and teardown)"
            )
        return self._precision

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The side stream of every warm-up step and capture, made once: the caching allocator keeps freed
        blocks per stream, so a stream per step would strand each step's cached memory.
        """
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _capture(self, step: Step, device: torch.device) -> Step:
        """``step`` captured (:func:`capture_graph`) on the side stream, into the pool every graph shares.

        Sharing is safe here: replays run one at a time on one stream, and :meth:`run` copies a replay's
        outputs before another graph runs, so between replays no graph's memory holds anything another graph
        reads.
        """
        if device.type != "cuda":  # the CPU stand-in of the tests
            return capture_graph(step)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return capture_graph(step, pool=self._pool, stream=self._side_stream(device))

    def _eager(self, step: Step, device: torch.device, count_syncs: bool) -> tuple[dict[str, Tensor], Tensor]:
        """A warm-up step, on the side stream as capture requires; the one before the capture counts host
        syncs.
        """
        side = self._side_stream(device) if device.type == "cuda" else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        counter = HostSyncs() if count_syncs else contextlib.nullcontext()
        checked = _syncs_raise(device) if count_syncs else contextlib.nullcontext()
        failure = None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext(), counter:
            try:
                with checked:
                    outputs = step()
            except RuntimeError as error:
                if not _is_sync_error(error):
                    raise
                failure = error
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        counted = counter.total if isinstance(counter, HostSyncs) else 0
        if failure is not None or counted:
            found = counter.table() if isinstance(counter, HostSyncs) else ""
            driver = f"\nCUDA's sync check: {failure}" if failure is not None else ""
            raise RuntimeError(
                f"callbacks.cuda_graph: the training step makes the host wait for the device {counted} "
                f"time(s) counted, which a CUDA graph cannot hold:\n{found}{driver}\n"
                "Remove the read at these sites (the step must be speedups.sync_free's)"
            ) from failure
        return outputs

    def _step_function(
        self,
        module: MaskRCNNModule,
        images: list[Tensor],
        targets: list[dict[str, Tensor]],
    ) -> Step:
        """Forward and loss under the precision's autocast (its cast cache off, as capture requires),
        backward, then the optimizer step as the precision plugin takes it (GradScaler or the non-finite
        guard), on device.
        """
        plugin = self._running_precision()
        optimizer = module.trainer.optimizers[0]
        scaler = plugin.scaler
        low = plugin.low_dtype
        device_type = images[0].device.type

        def step() -> tuple[dict[str, Tensor], Tensor]:
            optimizer.zero_grad(
                set_to_none=False
            )  # gradients stay in their buffers: the graph zeroes and refills
            with (
                torch.autocast(device_type, dtype=low, cache_enabled=False)
                if low is not None
                else contextlib.nullcontext()
            ):
                loss_dict = module.model(module.prepare_images(images), targets)
                loss = module.compute_loss(loss_dict)
            # Lightning runs the training step under the precision's autocast; backward and step run outside
            # it
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
        """Hands the step back to Lightning and the optimizer back as it was built
        (:func:`restore_configuration`), and frees the graphs.
        """
        if stage == "fit" and isinstance(pl_module, MaskRCNNModule) and pl_module.captured_step is self:
            pl_module.set_captured_step(None)
            carry_step_count(trainer, to_manual=False)
            if self._flags is not None and trainer.optimizers:
                restore_configuration(trainer.optimizers[0], self._flags)
            self._entries = {}
            self._flags = None
            self._stream = None
            self._pool = None
            self._precision = None

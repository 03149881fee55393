"""One row of ``bench train``, ``bench infer`` or ``bench precision``, run in this process through Lightning.

The row's config (:mod:`lit_amp_det.bench.rows`) runs as ``fit`` and ``predict`` run it, every step on one
batch of the shapes data's ``val`` images, its training targets padded as the data module pads them when the
row sets ``data.pad_instances``. :class:`RowTimer` times each step from batch start to end (forward, loss,
backward, optimizer step, callbacks' batch hooks), CUDA-synchronised, after the warm-up steps (a compiled
row's compile time). One more step measures the peak memory above what the built model used (the CUDA
allocator's peak, or the resident high-water mark with glibc's mmap threshold pinned and freed heap released
first) and counts its host syncs.
"""

from __future__ import annotations

import hashlib
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from lit_amp_det.bench.rows import Bench, Setting, compose, row_overrides
from lit_amp_det.precision import build_precision_plugin
from lit_amp_det.profiling import (
    MB,
    HostSyncs,
    MemoryProbe,
    pin_malloc_threshold,
    release_freed_cpu_memory,
    unpin_malloc_threshold,
)

__all__ = [
    "RowTimer",
    "build_trainer",
    "instantiate_model",
    "pad_training_targets",
    "run_row",
    "shapes_batch",
    "summarise",
    "weights_sha256",
]

Batch = tuple[list[Tensor], list[dict[str, Tensor]]]


def shapes_batch(split: str, indices: Sequence[int], height: int, width: int, num_classes: int) -> Batch:
    """Images ``indices`` of ``split`` of the embedded shapes data at ``height`` x ``width``: ``uint8`` ``[3,
    H, W]`` images (as the loaders deliver them) and targets as the COCO loader builds them (one instance per
    labelled shape, its visible mask and the tight ``xyxy`` box of that mask, and the ``image_id``); the 6
    shape classes fold onto the model's ``num_classes - 1`` foreground classes when it has fewer.
    """
    from lit_amp_det.data.shapes import ShapesSpec, render_shapes_image

    if num_classes < 2:
        raise ValueError(f"num_classes={num_classes}: a detector needs background plus at least one class")
    spec = ShapesSpec(image_size=(height, width))
    images, targets = [], []
    for index in indices:
        rendered = render_shapes_image(split, index, spec)
        shapes = [inst for inst in rendered.instances if inst.labelled]
        boxes = []
        for inst in shapes:
            rows = inst.visible_mask.any(axis=1).nonzero()[0]
            cols = inst.visible_mask.any(axis=0).nonzero()[0]
            boxes.append([float(cols[0]), float(rows[0]), float(cols[-1] + 1), float(rows[-1] + 1)])
        masks = (
            np.stack([inst.visible_mask for inst in shapes]) if shapes else np.zeros((0, height, width), bool)
        )
        images.append(torch.from_numpy(rendered.image).permute(2, 0, 1).contiguous())
        targets.append(
            {
                "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
                "labels": torch.tensor(
                    [(inst.category_id - 1) % (num_classes - 1) + 1 for inst in shapes], dtype=torch.int64
                ),
                "masks": torch.from_numpy(masks).to(torch.uint8),
                "image_id": torch.tensor(index),
            }
        )
    return images, targets


def pad_training_targets(cfg: DictConfig, targets: Sequence[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
    """``targets`` as the data module hands a training batch to the step: padded to ``data.pad_instances``
    instances by the data module's own :func:`~lit_amp_det.data.coco.pad_instances` (a ``valid`` flag each),
    unchanged when it is null. The bench feeds its batches without the data module, and a fixed-shape step
    (the CUDA graph) refuses targets whose shapes could change.

    Args:
        cfg: the row's composed config; ``cfg.data.pad_instances`` is read.
        targets: one dict per image, with ``boxes`` ``[N, 4]`` and the other per-instance fields ``[N, ...]``.

    Returns:
        One dict per image, its per-instance fields ``[pad_instances, ...]`` and ``valid`` ``[pad_instances]``
        when padding is asked for; otherwise the targets as given.
    """
    from lit_amp_det.data.coco import pad_instances

    count = cfg.data.get("pad_instances")
    if count is None:
        return list(targets)
    return [pad_instances(target, int(count)) for target in targets]


def weights_sha256(module: torch.nn.Module) -> str:
    """SHA-256 of ``module``'s state dict (names, dtypes, shapes, values): equal in every row that loaded one
    state.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        value = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def summarise(seconds: Sequence[float], prefix: str) -> dict[str, Any]:
    """``<prefix>_ms_median`` and ``<prefix>_ms_all`` (every time, in run order) of ``seconds``, in ms."""
    ms = [1000 * s for s in seconds]
    return {f"{prefix}_ms_median": statistics.median(ms), f"{prefix}_ms_all": ms}


class RowTimer(pl.Callback):
    """Times the batches of one fit or predict run by ``plan``: per batch index ``warmup``, a timing name, or
    ``memory`` (the peak-memory step, last: on a CPU it pins glibc's mmap threshold while it runs).
    """

    def __init__(self, plan: Sequence[str]) -> None:
        self.plan = list(plan)
        self.times: dict[str, list[float]] = {}
        self.detections = 0
        self.peak: dict[str, float] = {}
        self.probe: MemoryProbe | None = None  # set when the run starts
        self._baseline = 0
        self._started = 0.0
        self._pinned = False
        self._syncs: HostSyncs | None = None

    def _end_memory_step(self) -> None:
        if self._syncs is not None:  # the step's counter and pinned threshold end with it, even when it fails
            self._syncs.__exit__(None, None, None)
            self._syncs = None
        if self._pinned:
            unpin_malloc_threshold()
            self._pinned = False

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._end_memory_step()  # a failed memory step must not leave this process's allocator pinned

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.probe = MemoryProbe(trainer.strategy.root_device)
        if not self.probe.cuda:
            release_freed_cpu_memory()
        self.probe.synchronize()
        self._baseline = self.probe.baseline_bytes()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.plan[batch_idx] == "memory":
            if not self.probe.cuda:
                pin_malloc_threshold()
                self._pinned = True
                release_freed_cpu_memory()
            self.probe.reset_peak()
            self._syncs = HostSyncs().__enter__()
        self.probe.synchronize()
        self._started = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.probe.synchronize()
        seconds = time.perf_counter() - self._started
        kind = self.plan[batch_idx]
        if kind == "memory":
            syncs = self._syncs
            self._end_memory_step()
            peak = self.probe.peak_bytes()
            self.peak = {
                "peak_memory_mb": (peak - self._baseline) / MB,
                "peak_memory_abs_mb": peak / MB,
                "host_syncs_per_step": syncs.total,
            }
        else:
            self.times.setdefault(kind, []).append(seconds)

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.on_train_start(trainer, pl_module)

    @override
    def on_predict_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.detections = sum(len(p["boxes"]) for p in outputs)  # of the last call


def build_trainer(cfg: DictConfig, callbacks: Sequence[pl.Callback], **options: Any) -> pl.Trainer:
    """The ``Trainer`` of ``cfg.trainer`` with the precision plugin of ``trainer.precision`` and
    ``precision``, and ``callbacks``; no logger, checkpoints, progress bar or validation. ``options`` override
    trainer arguments.
    """
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.paths.output_dir = tempfile.gettempdir()  # default_root_dir: nothing is written there
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    plugin = build_precision_plugin(
        str(trainer_cfg.pop("precision")),
        str(trainer_cfg["accelerator"]),
        **OmegaConf.to_container(cfg.precision, resolve=True),
    )
    trainer_cfg.update(
        {
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            "limit_val_batches": 0,
            "max_epochs": 1,
            "max_steps": -1,
            **options,
        }
    )
    return instantiate(trainer_cfg, callbacks=list(callbacks), plugins=[plugin])


def instantiate_model(cfg: DictConfig) -> Any:
    """The module of ``cfg.model`` (a :class:`~lit_amp_det.MaskRCNNModule`), as ``fit`` instantiates it."""
    return instantiate(cfg.model, _convert_="all")


def _plan(bench: Bench, setting: Setting, cfg: DictConfig) -> tuple[list[str], DataLoader]:
    """What each batch of the row's run is for (see :class:`RowTimer`), and the loader that serves them.

    A compiled row warms up for longer (``setting.compile_warmup`` steps), so that its compile time stays out
    of the timed steps. A ``fit`` run repeats one training batch, its targets padded as the row's data module
    would pad them; a ``predict`` run warms up at batch one and at the full batch before anything is timed
    (compile traces each input shape), then times latency at batch one and throughput at the full batch.
    """
    warmup = setting.compile_warmup if cfg.speedups.get("compile") else setting.warmup
    images, targets = shapes_batch(
        "val", range(setting.batch), setting.height, setting.width, setting.num_classes
    )
    if bench.stage == "fit":
        plan = ["warmup"] * warmup + ["step"] * setting.steps + ["memory"]
        batches = [(images, pad_training_targets(cfg, targets))] * len(plan)
    else:
        single = (images[:1], targets[:1])
        full = (images, targets)
        plan = ["warmup"] * 2 * warmup + ["latency"] * setting.steps + ["batch"] * setting.steps + ["memory"]
        batches = (
            [single] * warmup + [full] * warmup + [single] * setting.steps + [full] * (setting.steps + 1)
        )
    loader = DataLoader(batches, batch_size=None, collate_fn=lambda batch: batch)  # type: ignore[arg-type]
    return plan, loader


def run_row(bench: Bench, index: int, setting: Setting) -> dict[str, Any]:
    """Runs ``bench.rows[index]`` for ``setting`` in this process; its step times, peak memory and what
    ran.
    """
    from lit_amp_det.app.tasks import instantiate_all

    cfg = compose(row_overrides(bench, index, setting))
    started = time.perf_counter()
    torch.manual_seed(0)  # the random state's weights; model.weights, when set, replaces them all
    module = instantiate_model(cfg)
    loaded = weights_sha256(module.model)
    plan, loader = _plan(bench, setting, cfg)
    timer = RowTimer(plan)
    callbacks = [timer, *instantiate_all(cfg.get("callbacks"), "callbacks")]
    trainer = build_trainer(cfg, callbacks)
    if bench.stage == "fit":
        trainer.fit(module, train_dataloaders=loader)
    else:
        trainer.predict(module, dataloaders=loader, return_predictions=False)
    result = {
        key: value
        for timing in bench.timings
        for key, value in summarise(timer.times[timing], timing).items()
    }
    result["images_per_s"] = setting.batch * 1000 / result[f"{bench.timings[-1]}_ms_median"]
    result.update(
        timer.peak,
        memory_source=timer.probe.source,
        warmup_steps=plan.count("warmup"),
        warmup_s=sum(timer.times.get("warmup", [])),
        run_s=time.perf_counter() - started,
        weights_sha256=loaded,
        precision=trainer.precision_plugin.precision,
        speedups=module.applied_speedups,
        callbacks=[type(c).__name__ for c in callbacks[1:]],
    )
    if bench.stage == "fit":
        optimizer = trainer.optimizers[0]
        result["lr"] = optimizer.param_groups[0]["lr"]
        result["optimizer"] = {
            "type": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
            "fused": bool(optimizer.defaults.get("fused")),
        }
    else:
        result["detections_per_call"] = timer.detections
    return result

"""The model state the benches time: made once by training, cached on disk, loaded by every row.

A step's time depends on the model's state, not only on its switches: an untrained Mask R-CNN proposes boxes
that match nothing, and one trained at a constant high learning rate from random weights collapses, with
proposal and detection counts (so step times) unlike a real run's. So every row starts from one representative
state: the setting's model trained with ``fit``'s machinery (never timed) for ``steps`` steps of the first
row's config (torchvision's model in fp32, ``optim=sgd`` with its warm-up and multistep schedule), ``batch``
images a step from the first :data:`TRAIN_IMAGES` shapes ``train`` images at the bench's size. A model whose
lr belongs to a larger batch (:data:`RECIPE_REFERENCE_BATCH`) trains at that lr scaled linearly to the bench's
batch, as ``optim.reference_batch`` scales it in ``fit``; unscaled, a randomly initialised R50-FPN diverges at
batch 2.

The file is a Lightning-style checkpoint that rows load through ``model.weights``, as a user would; a JSON
next to it records how it was made, the hash of its weights and the lr its schedule ended at (the rows' timing
lr).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from lit_amp_det.bench.measure import build_trainer, instantiate_model, shapes_batch, weights_sha256
from lit_amp_det.bench.rows import BENCHES, Setting, compose, row_overrides
from lit_amp_det.optim import scale_lr

__all__ = [
    "FORMAT",
    "RECIPE_REFERENCE_BATCH",
    "TRAIN_IMAGES",
    "cache_root",
    "ensure_state",
    "make_state",
    "state_key",
    "state_overrides",
    "state_paths",
]

#: Bump when how the state is made changes, so cached states from older code are not reused.
FORMAT = 2
#: Training images a state cycles through (rendered once, kept in memory).
TRAIN_IMAGES = 128
#: model config -> the global batch its configured lr is given for (``experiment=coco_r50_fpn`` sets the
#: same).
RECIPE_REFERENCE_BATCH = {"maskrcnn_r50_fpn": 16}


def cache_root(given: str | Path | None = None) -> Path:
    """The benches' cache folder: ``given``, else ``$LIT_AMP_DET_CACHE``, else ``~/.cache/lit_amp_det`` (the
    default of ``paths.cache_dir``, so that the benches and ``fit`` share it).
    """
    return Path(given or os.environ.get("LIT_AMP_DET_CACHE") or "~/.cache/lit_amp_det").expanduser().resolve()


def _replace_file(path: Path, data: bytes) -> None:
    """Writes through a temporary file and a rename, so that a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def state_overrides(setting: Setting) -> list[str]:
    """The first ``bench train`` row's overrides without a state to load, at the recipe's lr for the bench
    batch.
    """
    overrides = row_overrides(BENCHES["train"], 0, dataclasses.replace(setting, weights=None, lr=None))
    reference = RECIPE_REFERENCE_BATCH.get(setting.model)
    if reference is not None:
        optimizer = OmegaConf.to_container(compose(overrides).optim.optimizer, resolve=True)
        overrides.append(f"optim.optimizer.lr={scale_lr(optimizer, setting.batch, reference)['lr']!r}")
    return overrides


def state_key(setting: Setting, steps: int) -> dict[str, Any]:
    """Everything the state made for ``setting`` in ``steps`` steps depends on (its cache key), with
    :data:`FORMAT`.
    """
    model = OmegaConf.to_container(compose(state_overrides(setting)).model, resolve=True)
    return {
        "format": FORMAT,
        "model_name": setting.model,
        "model": model,
        "height": setting.height,
        "width": setting.width,
        "batch": setting.batch,
        "num_classes": setting.num_classes,
        "steps": steps,
        "train_images": TRAIN_IMAGES,
        "device": setting.device,
        "torch": torch.__version__,
    }


def state_paths(key: dict[str, Any], cache: Path) -> tuple[Path, Path]:
    """The state file and its JSON record under ``cache/bench_state/``, named after the key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
    stem = (
        f"{key['model_name']}-{key['height']}x{key['width']}-b{key['batch']}-c{key['num_classes']}-"
        f"{key['steps']}steps-{key['device']}-{digest}"
    )
    return cache / "bench_state" / f"{stem}.pt", cache / "bench_state" / f"{stem}.json"


class _TrainImages(Dataset):
    """The first :data:`TRAIN_IMAGES` shapes ``train`` images at the setting's size, each rendered once."""

    def __init__(self, setting: Setting) -> None:
        self.setting = setting
        self.rendered: dict[int, Any] = {}

    def __len__(self) -> int:
        return TRAIN_IMAGES

    def __getitem__(self, index: int) -> Any:
        if index not in self.rendered:
            s = self.setting
            images, targets = shapes_batch("train", [index], s.height, s.width, s.num_classes)
            self.rendered[index] = (images[0], targets[0])
        return self.rendered[index]


class _Losses(pl.Callback):
    """Records each step's loss, prints progress to ``log`` and stops on a loss that is not finite."""

    def __init__(self, steps: int, log: Any) -> None:
        self.steps = steps
        self.stream = log
        self.losses: list[float] = []

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = float(outputs["loss"])
        step = len(self.losses) + 1
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        if not math.isfinite(loss):
            raise RuntimeError(
                f"bench state: the loss became {loss} at step {step} of {self.steps} (lr {lr:.3g}); "
                "pass fewer --state-steps, or --state random"
            )
        self.losses.append(loss)
        if step % max(1, self.steps // 10) == 0 or step == self.steps:
            print(
                f"  state step {step}/{self.steps}: loss {loss:.3f}, lr {lr:.3g}",
                file=self.stream,
                flush=True,
            )


def make_state(setting: Setting, steps: int, path: Path, log: Any = sys.stderr) -> dict[str, Any]:
    """Trains the state for ``setting`` (see the module doc) and saves it to ``path``; returns its record."""
    cfg = compose(state_overrides(setting))
    start = time.perf_counter()
    torch.manual_seed(0)
    module = instantiate_model(cfg)
    losses = _Losses(steps, log)
    loader = DataLoader(
        _TrainImages(setting),
        batch_size=setting.batch,
        drop_last=True,
        collate_fn=lambda items: ([image for image, _ in items], [target for _, target in items]),
    )
    trainer = build_trainer(cfg, [losses], max_epochs=-1, max_steps=steps)
    trainer.fit(module, train_dataloaders=loader)
    buffer = io.BytesIO()
    torch.save(
        {
            "state_dict": {k: v.detach().cpu() for k, v in module.state_dict().items()},
            "hyper_parameters": dict(module.hparams),
        },
        buffer,
    )
    _replace_file(path, buffer.getvalue())
    optimizer = cfg.optim.optimizer
    return {
        "file": str(path),
        "weights_sha256": weights_sha256(module.model),
        "final_lr": trainer.optimizers[0].param_groups[0]["lr"],
        "steps": steps,
        "loss_first": losses.losses[0],
        "loss_last": losses.losses[-1],
        "make_s": time.perf_counter() - start,
        "made_at": datetime.datetime.now().isoformat(timespec="seconds"),
        "recipe": f"{optimizer._target_} lr {optimizer.lr:.3g}, {cfg.optim.scheduler.policy} schedule with "
        f"{cfg.optim.scheduler.warmup_steps} warm-up steps over {steps} steps, batch {setting.batch}, "
        f"the shapes data's first {TRAIN_IMAGES} train images at {setting.size}, fp32, torchvision's "
        "model, no callbacks",
    }


def ensure_state(setting: Setting, steps: int, cache: Path, log: Any = sys.stderr) -> dict[str, Any]:
    """The cached state for ``setting`` and ``steps``, made first if the cache has none; its record (see
    :func:`make_state`) with ``cached`` (whether it was there already) and ``key``.
    """
    key = state_key(setting, steps)
    path, record_path = state_paths(key, cache)
    if path.is_file() and record_path.is_file():
        return {**json.loads(record_path.read_text()), "file": str(path), "cached": True, "key": key}
    print(
        f"making the bench state: {setting.model}, {steps} training steps at {setting.size}, "
        f"batch {setting.batch} (once; cached in {path.parent}) ...",
        file=log,
        flush=True,
    )
    record = make_state(setting, steps, path, log)
    _replace_file(record_path, json.dumps({**record, "key": key}, indent=2, default=str).encode())
    return {**record, "cached": False, "key": key}

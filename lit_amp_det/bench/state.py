"""The model state the benches time: made once by training, cached on disk, loaded by every row.

A step's time depends on the model's state, not only on its switches: an untrained Mask R-CNN proposes boxes
that match nothing, and one trained at a constant high learning rate from random weights collapses (the
R50-FPN at 256x256, batch 2, runs a step in 0.6 s collapsed and 1.8 s on the warm-up schedule). So the benches
start every row from one representative state: the setting's model trained for ``steps`` steps of the real
recipe on the embedded shapes data at the bench's image size, the first row's config (fp32, torchvision's
ops, ``optim=sgd`` with its warm-up and multistep schedule over ``steps`` steps, no callbacks), on ``batch``
images a step cycling through the first :data:`TRAIN_IMAGES` ``train`` images. Making it is never timed. Models
whose configured lr belongs to a larger reference batch (:data:`RECIPE_REFERENCE_BATCH`: the R50-FPN's 0.02 is
torchvision's lr for 16 images) train with it scaled linearly to the bench's batch, as ``optim.reference_batch``
scales it in ``fit``; at 0.02 for 2 images a randomly initialised R50-FPN (frozen, untrained norms) diverges
within 60 steps.

The file is a Lightning-style checkpoint (``state_dict`` with ``model.`` keys, ``hyper_parameters``) that rows
load through ``model.checkpoint``, as a user would; a JSON next to it records how it was made, the hash of its
weights and the learning rate its schedule ended at (the rows' timing learning rate). The cache key is
everything that changes the state: the resolved model and optimizer config, image size, batch, class count,
steps, device type, torch version and :data:`FORMAT`.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from lit_amp_det.bench.common import compose, replace_file, shapes_batch, train_step, weights_sha256
from lit_amp_det.bench.e2e_rows import Setting, baseline_overrides, build
from lit_amp_det.optim import scale_lr

__all__ = ["FORMAT", "RECIPE_REFERENCE_BATCH", "TRAIN_IMAGES", "ensure_state", "make_state", "state_key",
           "state_paths"]

#: Bump when how the state is made changes, so cached states from older code are not reused.
FORMAT = 1
#: Training images a state cycles through (rendered once, kept in memory).
TRAIN_IMAGES = 128
#: model config -> the global batch its configured lr is given for (``experiment=coco_r50_fpn`` sets the same);
#: the state's lr is scaled to the bench batch. Other models' lr is used as configured.
RECIPE_REFERENCE_BATCH = {"maskrcnn_r50_fpn": 16}


def _state_overrides(setting: Setting) -> list[str]:
    """The first row's overrides without a checkpoint, plus the model's reference batch where it has one."""
    overrides = baseline_overrides(dataclasses.replace(setting, checkpoint=None))
    reference = RECIPE_REFERENCE_BATCH.get(setting.model)
    return overrides if reference is None else [*overrides, f"optim.reference_batch={reference}"]


#: Model switches (dotted paths in ``cfg.model``) added after states were first cached, with the value the first row
#: (which makes the state) gives them. At that value they change nothing the state's training computes, so the key
#: leaves them out: adding a switch keeps the states already cached valid (an R50-FPN state takes over 20 minutes to
#: make on 2 cores). ``optimizer.memory_order_views`` acts on fused optimizers only; the first row's is not fused.
KEY_OMITS_AT = {"winograd_output_tile": 2, "optimizer.memory_order_views": True, "winograd_weight_tile_cache": False,
                "binary_mask_paste": False}


def state_key(setting: Setting, steps: int) -> dict[str, Any]:
    """Everything the state made for ``setting`` in ``steps`` steps depends on (its cache key)."""
    cfg = compose(_state_overrides(setting))
    model = OmegaConf.to_container(cfg.model, resolve=True)
    for path, value in KEY_OMITS_AT.items():
        *parents, name = path.split(".")
        section = model
        for parent in parents:
            section = section.get(parent) if isinstance(section, dict) else None
        if isinstance(section, dict) and section.get(name) == value:
            del section[name]
    return {"format": FORMAT, "model_name": setting.model, "model": model, "height": setting.height,
            "width": setting.width, "batch": setting.batch, "num_classes": setting.num_classes, "steps": steps,
            "train_images": TRAIN_IMAGES, "device": setting.device, "torch": torch.__version__}


def state_paths(key: dict[str, Any], cache: Path) -> tuple[Path, Path]:
    """The state file and its JSON record under ``cache/bench_state/``, named after the key."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]
    stem = (f"{key['model_name']}-{key['height']}x{key['width']}-b{key['batch']}-c{key['num_classes']}-"
            f"{key['steps']}steps-{key['device']}-{digest}")
    folder = cache / "bench_state"
    return folder / f"{stem}.pt", folder / f"{stem}.json"


def _recipe(cfg: Any, setting: Setting, steps: int) -> str:
    """How the state was made, in words, for the report header."""
    schedule = cfg.optim.scheduler
    reference = cfg.optim.get("reference_batch")
    lr = f"{cfg.optim.optimizer.lr}" if not reference else (
        f"{scale_lr(cfg.optim.optimizer, setting.batch, reference)['lr']:g} ({cfg.optim.optimizer.lr} per "
        f"{reference} images, scaled to the batch)")
    return (f"first row's config (fp32, torchvision ops, no callbacks), {cfg.optim.optimizer._target_} lr "
            f"{lr} with {schedule.get('warmup_steps')} warm-up steps and the "
            f"{schedule.get('policy')} schedule over {steps} steps, batch {setting.batch}, cycling through the "
            f"shapes data's first {TRAIN_IMAGES} train images at {setting.size}")


def _train(setting: Setting, steps: int, module: Any, plugin: Any, log: Any) -> tuple[list[float], float]:
    """``steps`` steps of the recipe on ``module``; returns the losses and the learning rate it ended at."""
    from hydra.utils import instantiate

    from lit_amp_det.optim import build_optimizer

    config = module.hparams.optimizer
    if module.hparams.get("reference_batch"):  # the linear scaling rule, as fit applies it
        config = scale_lr(config, setting.batch, module.hparams.reference_batch)
    optimizer = build_optimizer(config, [p for p in module.parameters() if p.requires_grad])
    scheduler = None
    if module.hparams.scheduler:
        scheduler = instantiate(dict(module.hparams.scheduler), optimizer=optimizer, total_steps=steps)
    module.train()
    pool: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}  # rendered once, reused every epoch
    losses: list[float] = []
    for step in range(steps):
        indices = [(step * setting.batch + j) % TRAIN_IMAGES for j in range(setting.batch)]
        for index in set(indices) - pool.keys():
            images, targets = shapes_batch("train", [index], setting.height, setting.width, setting.num_classes,
                                           setting.device)
            pool[index] = (images[0], targets[0])
        lr = optimizer.param_groups[0]["lr"]
        loss = float(train_step(module, plugin, optimizer, [pool[i][0] for i in indices],
                                [pool[i][1] for i in indices]).detach())
        if not math.isfinite(loss):
            raise RuntimeError(f"bench state: the loss of {setting.model} became {loss} at step {step + 1} of {steps} "
                               f"(lr {lr:.3g}); pass fewer --state-steps, or --state random")
        losses.append(loss)
        if scheduler is not None:
            scheduler.step()
        if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:
            print(f"  state step {step + 1}/{steps}: loss {loss:.3f}, lr {lr:.3g}", file=log, flush=True)
    return losses, optimizer.param_groups[0]["lr"]


def make_state(setting: Setting, steps: int, path: Path, log: Any = sys.stderr) -> dict[str, Any]:
    """Trains the state for ``setting`` (see the module doc) and saves it to ``path``; returns its record.

    Raises ``RuntimeError`` naming the step if the loss stops being finite.
    """
    cfg = compose(_state_overrides(setting))
    start = time.perf_counter()
    built = build(cfg, setting.device, "fit")
    losses, final_lr = _train(setting, steps, built.module, built.plugin, log)
    buffer = io.BytesIO()
    torch.save({"state_dict": {k: v.detach().cpu() for k, v in built.module.state_dict().items()},
                "hyper_parameters": dict(built.module.hparams)}, buffer)
    replace_file(path, buffer.getvalue())
    return {"file": str(path), "weights_sha256": weights_sha256(built.module.model), "final_lr": final_lr,
            "steps": steps, "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
            "make_s": time.perf_counter() - start, "made_at": datetime.datetime.now().isoformat(timespec="seconds"),
            "recipe": _recipe(cfg, setting, steps)}


def ensure_state(setting: Setting, steps: int, cache: Path, log: Any = sys.stderr) -> dict[str, Any]:
    """The cached state for ``setting`` and ``steps``, made first if the cache has none.

    Returns its record (see :func:`make_state`) with ``cached`` (True when it was already there) and ``key``.
    """
    key = state_key(setting, steps)
    path, record_path = state_paths(key, cache)
    if path.is_file() and record_path.is_file():
        record = json.loads(record_path.read_text())
        return {**record, "file": str(path), "cached": True, "key": key}
    print(f"making the bench state: {setting.model}, {steps} training steps at {setting.size}, batch "
          f"{setting.batch} (once; cached in {path.parent}) ...", file=log, flush=True)
    record = make_state(setting, steps, path, log)
    replace_file(record_path, json.dumps({**record, "key": key}, indent=2, default=str).encode())
    return {**record, "cached": False, "key": key}

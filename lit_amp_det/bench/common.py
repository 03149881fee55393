"""What several benches share: the composed config, the input batches, one training step, the cache folder.

Two kinds of batch: :func:`detection_batch` (seeded noise images with box-shaped masks, for op and layer
benches) and :func:`shapes_batch` (images of the embedded shapes dataset with their real instances, rendered
in memory at any size, for the benches that time a model whose state was trained on that data). Measuring
itself (memory, saved tensors, timing) is in :mod:`lit_amp_det.profiling`.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig
from torch import Tensor

from lit_amp_det.cpu_model import amd_microarchitecture, cpu_name

__all__ = ["amd_microarchitecture", "batch_sha256", "cache_root", "compose", "cpu_name", "detection_batch",
           "replace_file", "shapes_batch", "tensors_sha256", "train_step", "weights_sha256", "write_json"]


def compose(overrides: Sequence[str]) -> DictConfig:
    """``conf/config.yaml`` composed with ``overrides``, as the CLI composes it (no Hydra run)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from lit_amp_det.app.config import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


def detection_batch(batch: int, height: int, width: int,
                    device: str) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    """``batch`` seeded float images in [0, 1) with 3 boxes, labels 1-3 and box-shaped masks each."""
    gen = torch.Generator().manual_seed(0)
    images, targets = [], []
    for _ in range(batch):
        images.append(torch.rand(3, height, width, generator=gen).to(device))
        boxes, masks = [], torch.zeros(3, height, width, dtype=torch.uint8)
        for k in range(3):
            x0, y0 = (torch.rand(2, generator=gen) * torch.tensor([width, height]) * 0.6).tolist()
            w, h = ((0.15 + 0.25 * torch.rand(2, generator=gen)) * torch.tensor([width, height])).tolist()
            boxes.append([x0, y0, x0 + w, y0 + h])
            masks[k, int(y0): int(y0 + h), int(x0): int(x0 + w)] = 1
        targets.append({"boxes": torch.tensor(boxes, device=device), "labels": torch.tensor([1, 2, 3], device=device),
                        "masks": masks.to(device)})
    return images, targets


def shapes_batch(split: str, indices: Sequence[int], height: int, width: int, num_classes: int,
                 device: str) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    """Images ``indices`` of ``split`` of the embedded shapes data, rendered at ``height`` x ``width``.

    Returns ``uint8`` ``[3, H, W]`` images (as the loaders deliver them) and targets as the COCO loader builds
    them from the files the dataset writes: one instance per labelled shape, its visible mask, and the tight
    ``xyxy`` box of that mask. The 6 shape classes fold onto the model's ``num_classes - 1`` foreground classes
    (``(category - 1) % (num_classes - 1) + 1``) when it has fewer.
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
            rows, cols = inst.visible_mask.any(axis=1).nonzero()[0], inst.visible_mask.any(axis=0).nonzero()[0]
            boxes.append([float(cols[0]), float(rows[0]), float(cols[-1] + 1), float(rows[-1] + 1)])
        masks = torch.from_numpy(np.stack([inst.visible_mask for inst in shapes])) if shapes else (
            torch.zeros(0, height, width, dtype=torch.bool))
        images.append(torch.from_numpy(rendered.image).permute(2, 0, 1).contiguous().to(device))
        targets.append({
            "boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4).to(device),
            "labels": torch.tensor([(inst.category_id - 1) % (num_classes - 1) + 1 for inst in shapes],
                                   dtype=torch.int64, device=device),
            "masks": masks.to(torch.uint8).to(device),
        })
    return images, targets


def train_step(module: Any, plugin: Any, optimizer: torch.optim.Optimizer, images: list[Tensor],
               targets: list[dict[str, Tensor]]) -> Tensor:
    """One training step as Lightning runs it for ``MaskRCNNModule``: forward and loss in the plugin's
    autocast context, then backward and the optimizer step as the plugin takes it after Lightning's hooks (the
    non-finite check, the fused master step where it applies; the GradScaler for fp16). With
    low-precision weights the optimizer must have been connected to the plugin (``plugin.connect``)."""
    with plugin.forward_context():
        loss = module.compute_loss(module.model(module.prepare_images(images), module.training_targets(targets)))
    optimizer.zero_grad(set_to_none=True)
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None:
        scaler.scale(loss).backward()
        master_weights = getattr(plugin, "weights", None)
        if master_weights is not None:  # low-precision weights: the scaler unscales the fp32 masters' gradients
            master_weights.grads_to_masters()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        plugin.step_if_finite(optimizer)  # fit's step after the hooks: the finite check, then the (fused) step
    return loss


def write_json(path: str | Path | None, data: dict[str, Any]) -> None:
    """Writes ``data`` as indented JSON to ``path`` (a bench's ``--json``), creating its folder; None: nothing."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def replace_file(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file and a rename, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def cache_root(given: str | Path | None = None) -> Path:
    """The benches' cache folder: ``given``, else ``$LIT_AMP_DET_CACHE``, else ``~/.cache/lit_amp_det``.

    The same default as ``paths.cache_dir`` (``conf/paths/default.yaml``), so the benches and ``fit`` share it.
    """
    return Path(given or os.environ.get("LIT_AMP_DET_CACHE") or "~/.cache/lit_amp_det").expanduser().resolve()


def tensors_sha256(tensors: Mapping[str, Tensor]) -> str:
    """SHA-256 of named tensors: names, dtypes, shapes and values (not memory layout or device)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        value = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def weights_sha256(module: torch.nn.Module) -> str:
    """SHA-256 of ``module``'s state dict (:func:`tensors_sha256`).

    Two modules with the same hash hold exactly the same weights and buffers; the benches record it per row
    to show that every row started from the same state.
    """
    return tensors_sha256(module.state_dict())


def batch_sha256(images: Sequence[Tensor], targets: Sequence[Mapping[str, Tensor]]) -> str:
    """SHA-256 of a detection batch (:func:`tensors_sha256`), recorded per row to show every row timed the same."""
    named = {f"{i}.image": image for i, image in enumerate(images)}
    named.update({f"{i}.{key}": value for i, target in enumerate(targets) for key, value in target.items()})
    return tensors_sha256(named)

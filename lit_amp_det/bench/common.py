"""What several benches share: the composed config, a seeded synthetic detection batch and one training step.

Measuring itself (memory, saved tensors, timing) is in :mod:`lit_amp_det.profiling`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch import Tensor

__all__ = ["compose", "detection_batch", "train_step", "write_json"]


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


def train_step(module: Any, plugin: Any, optimizer: torch.optim.Optimizer, images: list[Tensor],
               targets: list[dict[str, Tensor]]) -> Tensor:
    """One training step as Lightning runs it for ``MaskRCNNModule``: forward and loss in the plugin's
    autocast context, then backward and optimizer step (through the plugin's GradScaler for fp16)."""
    with plugin.forward_context():
        loss = module.compute_loss(module.model(module.prepare_images(images), module.training_targets(targets)))
    optimizer.zero_grad(set_to_none=True)
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()
    return loss


def write_json(path: str | Path | None, data: dict[str, Any]) -> None:
    """Writes ``data`` as indented JSON to ``path`` (a bench's ``--json``), creating its folder; None: nothing."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))

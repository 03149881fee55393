"""A callback for the DDP tests: each rank writes what it saw (strategy, dtypes, regions, speedups, shards,
weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback

from lit_amp_det.models.conv_bn import conv_bn_eval_enabled


class DDPProbe(Callback):
    """Writes ``ddp_probe_rank<K>.json`` into ``dirpath`` at the end of fit."""

    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)
        self.seen: dict[str, Any] = {"train_images": 0, "val_images": 0}
        self._hooks: list[Any] = []
        self._armed = (
            False  # hooks record real training steps only (MemoryMonitor runs copies of the model first)
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def remember(key: str):
            def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
                if not self._armed:
                    return
                tensor = next(iter(output.values())) if isinstance(output, dict) else output
                tensor = tensor[0] if isinstance(tensor, (tuple, list)) else tensor
                self.seen.setdefault(key, str(tensor.dtype))

            return hook

        model = pl_module.model
        self._hooks = [
            model.backbone.register_forward_hook(remember("backbone_dtype")),
            model.roi_heads.box_predictor.register_forward_hook(remember("box_predictor_dtype")),
        ]

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._armed = True
        self.seen["train_images"] += len(batch[0])
        self.seen.setdefault("train_ids", []).append(
            [trainer.current_epoch, [int(t["image_id"]) for t in batch[1]]]
        )
        model = pl_module.model
        self.seen.setdefault("conv_bn_eval", conv_bn_eval_enabled(model))
        self.seen.setdefault(
            "norms_in_train_mode",
            sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training for m in model.modules()),
        )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._armed = False

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metric = pl_module.val_metric
        if getattr(metric, "_probed", False):
            return
        compute = metric.compute

        def counted_compute() -> Any:  # after the module gathered the ranks' shards: the images scored
            self.seen.setdefault("images_scored", []).append(len(metric.groundtruth_labels))
            return compute()

        metric.compute, metric._probed = counted_compute, True

    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking:
            self.seen["val_images"] += len(batch[0])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for hook in self._hooks:
            hook.remove()
        rpn = pl_module.model.rpn
        record = {
            **self.seen,
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "wrapped_model": type(trainer.strategy.model).__name__,
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "precision_plugin": type(trainer.precision_plugin).__name__,
            "precision": trainer.precision_plugin.precision,
            "fp32_region_installed": "filter_proposals" in vars(rpn),
            "applied_speedups": pl_module.applied_speedups,
            "rpn_class": type(rpn).__name__,
            "transform_class": type(pl_module.model.transform).__name__,
            # the regions go onto the model the speedups made (BinaryMaskPaste replaces the transform)
            "transform_region_installed": "postprocess" in vars(pl_module.model.transform),
            "weights_checksum": float(sum(p.detach().double().sum() for p in pl_module.parameters())),
            "global_step": trainer.global_step,
        }
        self.dirpath.mkdir(parents=True, exist_ok=True)
        (self.dirpath / f"ddp_probe_rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=2))

"""A callback that kills its own process with SIGKILL: the harshest interruption, for the resume test."""

import os
import signal

from lightning.pytorch import Callback


class KillAtStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class RecordBatches(Callback):
    """Appends (global step, image ids, RNG fingerprint) per training batch to a file: resume debugging."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import torch

        ids = [int(t["image_id"]) for t in batch[1]]
        fingerprint = int(torch.get_rng_state().sum())
        params = float(sum(p.detach().double().sum() for p in pl_module.parameters()))
        with open(self.path, "a") as f:
            f.write(
                f"{trainer.global_step} {trainer.current_epoch} {batch_idx} {ids} "
                f"{fingerprint} {params:.10f}\n"
            )

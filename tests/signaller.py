"""A callback that sends its own process a signal at a given step: Ctrl-C / SIGTERM in the interrupt tests."""

import os
import signal
import time

from lightning.pytorch import Callback


class SignalAtStep(Callback):
    def __init__(self, step: int, signum: str = "SIGINT", times: int = 1) -> None:
        self.step = step
        self.signum = getattr(signal, signum)
        self.times = times

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


class SignalAtValidationBatch(Callback):
    """Sends ``signum`` at validation batch ``batch`` of a fit (not the sanity check) and writes the time it
    did to ``stamp``.
    """

    def __init__(self, batch: int, stamp: str, signum: str = "SIGTERM") -> None:
        self.batch, self.stamp, self.signum = batch, stamp, getattr(signal, signum)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking and batch_idx == self.batch:
            with open(self.stamp, "w") as sink:
                sink.write(repr(time.time()))
            os.kill(os.getpid(), self.signum)

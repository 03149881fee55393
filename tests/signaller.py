"""A callback that sends its own process a signal at a given step: Ctrl-C / SIGTERM in the interrupt tests."""

import os
import signal

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

"""The non-finite step guard: optimizer steps with inf/NaN gradients are skipped and counted, and a run of too
many in a row stops training with an error that says what to change.

GradScaler skips such steps for fp16 and the guard only counts them; bf16 and fp32 get the same protection
here. The check, the skip (:mod:`lit_amp_det.precision.skip`) and the counters stay on the device, so a step
needs no host sync. The host reads the counters every ``check_every_n_steps`` steps, when a checkpoint is
saved, and when asked (:attr:`NonFiniteStepGuard.skipped`), so the stop after ``max_consecutive`` skips in a
row can come up to ``check_every_n_steps - 1`` steps late; skipped steps change nothing, so those cost time
only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor

from lit_amp_det.precision._lightning_internals import run_after_closure_hooks
from lit_amp_det.precision.skip import DeviceSkippedStep, gradients, non_finite
from lit_amp_det.settings import PrecisionSettings

__all__ = [
    "MAX_CONSECUTIVE_SKIPS",
    "SKIP_CHECK_EVERY_N_STEPS",
    "NonFiniteStepGuard",
    "guarded_optimizer_step",
]

#: ``precision.max_consecutive_skips``'s default (its home: :class:`~lit_amp_det.settings.PrecisionSettings`):
#: the skips in a row that stop a run as diverged
MAX_CONSECUTIVE_SKIPS: int = PrecisionSettings.max_consecutive_skips
#: ``precision.skip_check_every_n_steps``'s default (:class:`~lit_amp_det.settings.PrecisionSettings`): the
#: recorded steps between two host reads of the counts
SKIP_CHECK_EVERY_N_STEPS: int = PrecisionSettings.skip_check_every_n_steps


class NonFiniteStepGuard:
    """Skips optimizer steps whose gradients are not finite, counts them on the device, and stops a diverged
    run.

    Args:
        precision: the ``trainer.precision`` that runs (for the messages).
        max_consecutive: raise once this many steps in a row were skipped
            (``precision.max_consecutive_skips``).
        check_every_n_steps: read the counters on the host every this many recorded steps
            (``precision.skip_check_every_n_steps``); the stop comes at most this many steps minus one late.

    Raises:
        ValueError: ``max_consecutive`` or ``check_every_n_steps`` below 1, naming the setting.
    """

    def __init__(
        self,
        precision: str,
        max_consecutive: int = MAX_CONSECUTIVE_SKIPS,
        check_every_n_steps: int = SKIP_CHECK_EVERY_N_STEPS,
    ) -> None:
        if max_consecutive < 1:
            raise ValueError(f"precision.max_consecutive_skips={max_consecutive!r}: give an integer >= 1")
        if check_every_n_steps < 1:
            raise ValueError(
                f"precision.skip_check_every_n_steps={check_every_n_steps!r}: give an integer >= 1"
            )
        self.precision, self.max_consecutive, self.check_every_n_steps = (
            precision,
            max_consecutive,
            check_every_n_steps,
        )
        # skipped steps in all, the current run of consecutive skips, the longest run since the host last read
        # them
        self._counts = torch.zeros(3, dtype=torch.int64)
        self._unread = 0  # steps recorded since the host last read the counts
        self._skipper = DeviceSkippedStep()

    def step(self, optimizer: torch.optim.Optimizer, tick: bool = True, **kwargs: Any) -> None:
        """``optimizer.step(**kwargs)`` unless a gradient is inf or NaN (decided and skipped on the device);
        counted (``tick``: see :meth:`record`).
        """
        skip = non_finite(gradients(optimizer))
        self._skipper.step(optimizer, skip, **kwargs)
        self.record(skip, tick)

    def record(self, skipped: Tensor, tick: bool = True) -> None:
        """Counts one optimizer step, skipped where ``skipped`` (a 0-dim bool tensor) is set, in place on the
        device (so a CUDA graph can hold it), then :meth:`tick` unless ``tick`` is false (a captured step
        ticks on replay).
        """
        self._counts = self._counts.to(skipped.device)  # the tensor itself where it is on that device already
        skip = skipped.to(torch.int64)
        total, run, longest = self._counts.unbind()
        total.add_(skip)
        run.add_(skip).mul_(skip)  # back to 0 on a step that was taken
        torch.maximum(longest, run, out=longest)
        if tick:
            self.tick()

    def tick(self) -> None:
        """One recorded step on the host: every ``check_every_n_steps`` ticks, checks the counts."""
        self._unread += 1
        if self._unread >= self.check_every_n_steps:
            self.check()

    def log(self, model: pl.LightningModule) -> None:
        """Logs ``train/skipped_steps`` as a device tensor (Lightning reads it when it writes its logs)."""
        model.log(
            "train/skipped_steps", self._counts[0].float(), on_step=True, on_epoch=False, prog_bar=False
        )

    def _read(self) -> tuple[int, int, int]:
        """The counts on the host (one transfer, a sync on a GPU): skipped, current run, longest run since
        last read.
        """
        total, run, longest = self._counts.tolist()
        return total, run, longest

    def check(self) -> None:
        """Reads the counts and raises when a run of ``max_consecutive`` skips happened since the last
        read.
        """
        total, _, longest = self._read()
        self._unread = 0
        self._counts[2].copy_(self._counts[1])  # the next longest run starts from the current one
        if longest >= self.max_consecutive:
            raise RuntimeError(
                f"{longest} consecutive optimizer steps had non-finite gradients under trainer.precision="
                f"{self.precision} ({total} skipped in all; the limit is precision.max_consecutive_skips="
                f"{self.max_consecutive}); training has diverged. Lower the learning rate "
                "(optim.optimizer.lr), clip gradients (trainer.gradient_clip_val=1.0), or raise "
                "precision.max_consecutive_skips. Checkpoints "
                "written so far are kept."
            )

    @property
    def skipped(self) -> int:
        """Optimizer steps skipped so far (a host read)."""
        return self._read()[0]

    @property
    def consecutive(self) -> int:
        """Skips in a row up to the last recorded step (a host read)."""
        return self._read()[1]

    def state_dict(self) -> dict[str, int]:
        total, run, _ = self._read()
        return {"skipped": total, "consecutive": run}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        run = int(state.get("consecutive", 0))
        self._counts = torch.tensor(
            [int(state.get("skipped", 0)), run, run], dtype=torch.int64, device=self._counts.device
        )


def guarded_optimizer_step(
    plugin: Precision,
    guard: NonFiniteStepGuard,
    optimizer: torch.optim.Optimizer,
    model: pl.LightningModule,
    closure: Callable[[], Any],
    step: Callable[..., None],
    **kwargs: Any,
) -> Any:
    """A plugin's ``optimizer_step`` without a GradScaler: forward and backward (``closure``), Lightning's
    ``on_before_optimizer_step`` hooks and gradient clipping, then ``step(optimizer, **kwargs)`` (the plugin's
    guarded step), as Lightning's ``MixedPrecision`` orders them; returns the closure's result.
    """
    closure_result = closure()
    run_after_closure_hooks(plugin, model, optimizer)
    if closure_result is None and model.automatic_optimization:
        return None  # the training step skipped backward on purpose
    step(optimizer, **kwargs)
    guard.log(model)
    return closure_result

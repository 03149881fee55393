"""The private Lightning API of ``lit_amp_det.precision._lightning_internals``: still there, with the
signature and the behaviour the precision plugins rely on. A Lightning upgrade that changes it fails here
first.
"""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn

from lit_amp_det.precision import build_precision_plugin
from lit_amp_det.precision._lightning_internals import run_after_closure_hooks


def test_after_closure_has_the_signature_the_plugins_call() -> None:
    method = getattr(Precision, "_after_closure", None)
    assert callable(method), (
        "lightning removed Precision._after_closure; see precision/_lightning_internals.py"
    )
    assert list(inspect.signature(method).parameters) == ["self", "model", "optimizer"]
    # Lightning's own GradScaler step (which 16-mixed uses and 16-weights mirrors) runs it between unscale and
    # step
    assert "self._after_closure(model, optimizer)" in inspect.getsource(MixedPrecision.optimizer_step)


class _Recording(pl.Callback):
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.events.append("callback")


class _Module(pl.LightningModule):
    """Large gradients, so norm clipping at 0.01 changes them; records what the hooks and the step see."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 2)
        self.events: list[str] = []
        self.step_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        return (10 * self.layer(torch.ones(4, 3))).pow(2).sum()

    def on_before_optimizer_step(self, optimizer) -> None:
        self.events.append("module")

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ) -> None:
        algorithm = getattr(
            gradient_clip_algorithm, "value", gradient_clip_algorithm
        )  # Lightning passes its enum
        self.events.append(f"clip {gradient_clip_val} {algorithm}")
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=1e-3)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._record_norm(opt))
        return optimizer

    def _record_norm(self, optimizer) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        self.step_norms.append(float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))))
        self.events.append("step")

    def train_dataloader(self):
        return [0] * 2


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-weights", "16-mixed", "16-weights"])
def test_the_hooks_and_clipping_run_between_backward_and_the_step(precision: str) -> None:
    """Every plugin, through ``run_after_closure_hooks`` or Lightning's own GradScaler step: the callbacks'
    hook, the module's hook, then clipping as the Trainer is configured, then the step on clipped gradients.
    """
    events: list[str] = []
    module = _Module()
    plugin = build_precision_plugin(precision, "cpu", fp16_on_cpu=True, init_scale=1.0)
    trainer = pl.Trainer(
        max_steps=2,
        plugins=[plugin],
        callbacks=[_Recording(events)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        gradient_clip_val=0.01,
        gradient_clip_algorithm="norm",
    )
    module.events = events
    trainer.fit(module)
    assert events == ["callback", "module", "clip 0.01 norm", "step"] * 2
    assert len(module.step_norms) == 2 and all(n <= 0.01 * (1 + 1e-3) for n in module.step_norms)


def test_run_after_closure_hooks_is_lightnings_after_closure(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(
        Precision, "_after_closure", lambda self, model, optimizer: calls.append((model, optimizer))
    )
    plugin, model, optimizer = Precision(), object(), object()
    run_after_closure_hooks(plugin, model, optimizer)  # type: ignore[arg-type]
    assert calls == [(model, optimizer)]

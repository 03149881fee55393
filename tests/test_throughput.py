"""Throughput: exact step times and images/s from a fake clock, real ones from a real fit, config and bad
input.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from conftest import SMOKE, CaptureLogger, compose_config
from lit_amp_det.app.tasks import build_trainer
from lit_amp_det.callbacks.throughput import Throughput

STEP_KEYS = ("train/step_ms", "train/images_per_s")
EPOCH_KEYS = ("train/step_ms_epoch", "train/images_per_s_epoch")


class TinyStep(pl.LightningModule):
    """A one-layer model trained on detection-shaped batches: ``(images, targets)`` tuples."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, _ = batch
        return torch.stack([self.layer(image.float().mean(dim=(1, 2))).sum() for image in images]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader(images: int = 10, batch_size: int = 4) -> DataLoader:
    """Batches of 4, 4 and 2 images (in order), each image with a target dict."""
    samples = [(torch.rand(3, 8, 8), {"labels": torch.tensor([1])}) for _ in range(images)]
    return DataLoader(samples, batch_size=batch_size, shuffle=False, collate_fn=lambda b: tuple(zip(*b)))


def _fit(callback: Throughput, epochs: int = 2) -> tuple[pl.Trainer, CaptureLogger]:
    logger = CaptureLogger()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=epochs,
        logger=logger,
        callbacks=[callback],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyStep(), train_dataloaders=_loader())
    return trainer, logger


def _fake_clock(step_seconds: list[float]) -> Iterator[float]:
    """Start and end times of consecutive timed steps lasting ``step_seconds``."""
    now = 1000.0
    for seconds in step_seconds:
        yield now
        now += seconds
        yield now
        now += 5.0  # time between steps (data loading, logging) is not counted


def test_logs_exact_step_times_rates_medians_and_epoch_values() -> None:
    callback = Throughput(window=2, warmup_steps=2)
    durations = [0.1, 0.2, 0.3, 0.4]  # the timed steps: epoch 0 batch 2, epoch 1 batches 0..2
    clock = _fake_clock(durations)
    callback._clock = lambda: next(clock)
    trainer, logger = _fit(callback)

    assert trainer.global_step == 6  # 2 epochs x batches of 4, 4, 2 images
    assert next(clock, None) is None, "every timed step read the clock twice, and no warm-up step read it"
    assert logger.values("train/step_ms") == pytest.approx([100.0, 200.0, 300.0, 400.0], rel=1e-6)
    rates = [2 / 0.1, 4 / 0.2, 4 / 0.3, 2 / 0.4]  # images / seconds per timed step
    medians = [rates[0], (rates[0] + rates[1]) / 2, (rates[1] + rates[2]) / 2, (rates[2] + rates[3]) / 2]
    assert logger.values("train/images_per_s") == pytest.approx(medians, rel=1e-6)
    assert logger.values("train/step_ms_epoch") == pytest.approx([100.0, 300.0], rel=1e-6)
    assert logger.values("train/images_per_s_epoch") == pytest.approx([2 / 0.1, 10 / 0.9], rel=1e-6)
    assert trainer.progress_bar_metrics["train/images_per_s"] == pytest.approx(medians[-1], rel=1e-6)
    assert "train/step_ms" not in trainer.progress_bar_metrics  # only images/s goes to the bar


def test_real_clock_values_are_positive_and_one_per_timed_step() -> None:
    trainer, logger = _fit(Throughput(window=3, warmup_steps=1), epochs=2)
    assert trainer.global_step == 6
    for key in STEP_KEYS:
        values = logger.values(key)
        assert len(values) == trainer.global_step - 1, key
        assert all(math.isfinite(v) and v > 0 for v in values), (key, values)
    for key in EPOCH_KEYS:
        values = logger.values(key)
        assert len(values) == trainer.current_epoch, key  # one per epoch
        assert all(math.isfinite(v) and v > 0 for v in values), (key, values)
    assert {key for _, metrics in logger.calls for key in metrics if key.startswith("train/")} == {
        *STEP_KEYS,
        *EPOCH_KEYS,
    }


def test_an_epoch_of_warmup_steps_logs_no_epoch_values() -> None:
    _, logger = _fit(Throughput(warmup_steps=3), epochs=1)  # the whole epoch is warm-up
    for key in (*STEP_KEYS, *EPOCH_KEYS):
        assert logger.values(key) == [], key


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, r"callbacks\.throughput\.window=0\b"),
        ({"window": 2.5}, r"callbacks\.throughput\.window=2\.5\b"),
        ({"warmup_steps": -1}, r"callbacks\.throughput\.warmup_steps=-1\b"),
    ],
)
def test_bad_arguments_fail_in_setup_with_the_field_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _fit(Throughput(**kwargs), epochs=1)


def test_config_adds_the_callback_to_the_default_ones(tmp_path: Path) -> None:
    cfg = compose_config([*SMOKE, "callbacks=[default,throughput]"], tmp_path)
    assert cfg.callbacks.throughput.window == 20 and cfg.callbacks.throughput.warmup_steps == 2
    callbacks = build_trainer(cfg).callbacks
    (throughput,) = [c for c in callbacks if isinstance(c, Throughput)]
    assert (throughput.window, throughput.warmup_steps) == (20, 2)
    assert any(type(c).__name__ == "RNGStateCheckpoint" for c in callbacks)  # the defaults are kept

"""Mixed precision end to end: a research fp32 region through the CLI, and bf16 vs fp32 accuracy parity."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from conftest import REPO, SMOKE, compose_config, only_run_dir, run_cli
from lit_amp_det.app.tasks import train


def test_research_force_fp32_method_takes_effect_under_the_plugin(tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    run_cli(["fit", *SMOKE, "trainer.max_epochs=1", "trainer.precision=bf16-mixed",
             "model._target_=research_fp32.FeatureStatsMaskRCNN"], cwd=tmp_path, env=env)
    rows = list(csv.DictReader((only_run_dir(tmp_path / "runs") / "logs" / "metrics.csv").open()))
    checks = [float(r["train/fp32_checks"]) for r in rows if r.get("train/fp32_checks")]
    assert checks and checks[-1] >= 4  # the region ran (and asserted fp32 inputs) on every training step


# An easy problem the light model starts to learn within 300 steps: one or two large shapes per image.
PARITY = [
    "data.image_size=96", "data.train_size=400", "data.val_size=50", "data.test_size=10", "data.max_objects=2",
    "data.min_object_size=0.35", "data.max_object_size=0.6", "model.transform.min_size=128",
    "model.transform.max_size=128", "trainer.max_epochs=3", "trainer.check_val_every_n_epoch=3",
    "trainer.log_every_n_steps=10", "callbacks=none", "trainer.enable_progress_bar=false",
]


def _fit(tmp_path: Path, precision: str) -> tuple[dict, list[float]]:
    out = tmp_path / precision
    metrics = train(compose_config([*PARITY, f"trainer.precision={precision}"], out))
    rows = list(csv.DictReader((out / "logs" / "metrics.csv").open()))
    return metrics, [float(r["train/loss"]) for r in rows if r.get("train/loss")]


@pytest.mark.slow
def test_bf16_training_matches_fp32_accuracy(tmp_path: Path) -> None:
    fp32, fp32_losses = _fit(tmp_path, "32-true")
    bf16, bf16_losses = _fit(tmp_path, "bf16-mixed")
    assert fp32["val/segm_mAP_50"] > 0.12, fp32  # both models learned something worth comparing
    for key in ("val/segm_mAP", "val/bbox_mAP"):
        assert abs(bf16[key] - fp32[key]) <= 0.02, (key, bf16[key], fp32[key])
    assert len(fp32_losses) == len(bf16_losses) == 30
    late = slice(15, None)  # once past the first steps the curves must agree on average within 10 %
    mean_fp32, mean_bf16 = sum(fp32_losses[late]) / 15, sum(bf16_losses[late]) / 15
    assert abs(mean_bf16 - mean_fp32) <= 0.1 * mean_fp32, (fp32_losses, bf16_losses)

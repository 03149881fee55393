"""Mixed precision end to end: a research fp32 region through the CLI, bf16 vs fp32 accuracy parity, and bf16
weights with fp32 masters vs bf16 autocast.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from conftest import REPO, SMOKE, compose_config, only_run_dir, run_cli
from lit_amp_det.app.tasks import train


@pytest.mark.slow
def test_research_force_fp32_method_takes_effect_under_the_plugin(tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    run_cli(
        [
            "fit",
            *SMOKE,
            "trainer.max_epochs=1",
            "trainer.precision=bf16-mixed",
            "model._target_=research_fp32.FeatureStatsMaskRCNN",
        ],
        cwd=tmp_path,
        env=env,
    )
    rows = list(csv.DictReader((only_run_dir(tmp_path / "runs") / "logs" / "metrics.csv").open()))
    checks = [float(r["train/fp32_checks"]) for r in rows if r.get("train/fp32_checks")]
    assert checks and checks[-1] >= 4  # the region ran (and asserted fp32 inputs) on every training step


# An easy problem the light model starts to learn within 300 steps: one or two large shapes per image.
PARITY = [
    "data.image_size=96",
    "data.train_size=400",
    "data.val_size=50",
    "data.test_size=10",
    "data.max_objects=2",
    "data.min_object_size=0.35",
    "data.max_object_size=0.6",
    "model.transform.min_size=128",
    "model.transform.max_size=128",
    "trainer.max_epochs=3",
    "trainer.check_val_every_n_epoch=3",
    "trainer.log_every_n_steps=10",
    "callbacks=none",
    "trainer.enable_progress_bar=false",
]


def _fit(tmp_path: Path, precision: str) -> tuple[dict, list[float]]:
    out = tmp_path / precision
    metrics = train(compose_config([*PARITY, f"trainer.precision={precision}"], out))
    rows = list(csv.DictReader((out / "logs" / "metrics.csv").open()))
    return metrics, [float(r["train/loss"]) for r in rows if r.get("train/loss")]


def _assert_learns_alike(reference: tuple[dict, list[float]], other: tuple[dict, list[float]]) -> None:
    """Both runs learned (segm mAP@50 > 0.12), their mAPs agree within the spread of seeds and the mean of
    their last 15 logged losses within 10 % (once past the first steps the curves must agree on average).

    At 300 steps this recipe's mAP depends on the seed more than on the precision: which proposals get sampled
    changes with the first rounding difference, so two precisions with one seed diverge like two seeds.
    Measured on an AVX-512 BF16 CPU, seeds 0-2: segm/bbox mAP 0.091-0.118 / 0.091-0.131 in 32-true,
    0.077-0.164 / 0.098-0.195 in bf16-mixed, 0.115-0.167 / 0.116-0.183 in bf16-weights (every mAP@50 >= 0.16;
    same-seed pairs differ by up to 0.052 / 0.082, late loss means by up to 7.5 %). A broken precision path
    does not learn: mAP@50 near 0.
    """
    (ref, ref_losses), (run, run_losses) = reference, other
    for metrics in (ref, run):
        assert metrics["val/segm_mAP_50"] > 0.12, metrics  # a model that learned something worth comparing
    for key in ("val/segm_mAP", "val/bbox_mAP"):
        assert abs(run[key] - ref[key]) <= 0.1, (key, run[key], ref[key])
    assert len(ref_losses) == len(run_losses) == 30
    mean_ref, mean_run = sum(ref_losses[15:]) / 15, sum(run_losses[15:]) / 15
    assert abs(mean_run - mean_ref) <= 0.1 * mean_ref, (ref_losses, run_losses)


@pytest.mark.slow
@pytest.mark.bf16_training
def test_bf16_training_matches_fp32_accuracy(tmp_path: Path) -> None:
    _assert_learns_alike(_fit(tmp_path, "32-true"), _fit(tmp_path, "bf16-mixed"))


@pytest.mark.slow
@pytest.mark.bf16_training
def test_bf16_weights_training_matches_bf16_mixed_accuracy(tmp_path: Path) -> None:
    """bf16-weights runs the same bf16 convolutions as bf16-mixed (the first step's losses are bit-identical,
    see tests/test_low_precision_weights.py) and steps fp32 masters, so it must learn as well.
    """
    _assert_learns_alike(_fit(tmp_path, "bf16-mixed"), _fit(tmp_path, "bf16-weights"))

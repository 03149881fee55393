"""Mixed precision end to end: a research module's own fp32 region takes effect through the CLI."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from conftest import REPO, SMOKE, only_run_dir, run_cli


def test_research_force_fp32_method_takes_effect_under_the_plugin(tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    run_cli(["fit", *SMOKE, "trainer.max_epochs=1", "trainer.precision=bf16-mixed",
             "model._target_=research_fp32.FeatureStatsMaskRCNN"], cwd=tmp_path, env=env)
    rows = list(csv.DictReader((only_run_dir(tmp_path / "runs") / "logs" / "metrics.csv").open()))
    checks = [float(r["train/fp32_checks"]) for r in rows if r.get("train/fp32_checks")]
    assert checks and checks[-1] >= 4  # the region ran (and asserted fp32 inputs) on every training step

"""A run killed mid-epoch and resumed with ckpt_path=last ends exactly like an uninterrupted one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import REPO, SMOKE, run_cli

COMMON = [
    *SMOKE,
    "trainer.max_epochs=3",
    "trainer.deterministic=true",
    "callbacks.last_checkpoint.every_n_train_steps=2",
]


def _final(run_root: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    (metrics_file,) = run_root.glob("fit/*/metrics.json")
    last = torch.load(
        metrics_file.parent / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True
    )
    return json.loads(metrics_file.read_text())["metrics"], last["state_dict"]


@pytest.mark.slow
def test_killed_mid_epoch_run_resumes_to_identical_result(tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    run_cli(["fit", *COMMON], cwd=tmp_path, env={**env, "LIT_AMP_DET_RUNS": str(straight)})

    # 16 images / batch 4 = 4 steps per epoch; the last checkpoint before the kill is at step 6 (mid-epoch 1)
    killed = run_cli(
        ["fit", *COMMON, "+callbacks.killer._target_=killer.KillAtStep", "+callbacks.killer.step=7"],
        cwd=tmp_path,
        env={**env, "LIT_AMP_DET_RUNS": str(interrupted)},
        check=False,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    (killed_ckpt,) = interrupted.glob("fit/*/checkpoints/last.ckpt")
    assert torch.load(killed_ckpt, map_location="cpu", weights_only=True)["global_step"] == 6

    resumed = run_cli(
        ["fit", *COMMON, "ckpt_path=last"], cwd=tmp_path, env={**env, "LIT_AMP_DET_RUNS": str(interrupted)}
    )
    assert str(killed_ckpt) in resumed.stdout + resumed.stderr  # it said which checkpoint it resumed

    expected_metrics, expected_state = _final(straight)
    resumed_runs = sorted(p for p in interrupted.glob("fit/*/metrics.json"))
    assert len(resumed_runs) == 1  # the killed run wrote no metrics, only checkpoints
    got_metrics, got_state = _final(interrupted)
    assert {k: v for k, v in got_metrics.items() if k.startswith("val/")} == {
        k: v for k, v in expected_metrics.items() if k.startswith("val/")
    }
    assert expected_state.keys() == got_state.keys()
    for key, value in expected_state.items():
        assert torch.equal(value, got_state[key]), key

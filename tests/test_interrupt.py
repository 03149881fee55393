"""Ctrl-C and SIGTERM mid-fit: a checkpoint and the metrics so far are saved, the resume command printed and exact."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
import torch

from conftest import REPO, SMOKE, assert_same_last_weights, run_cli

COMMON = [*SMOKE, "trainer.deterministic=true"]
ENV = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}


def _signal_at(step: int, signum: str) -> list[str]:
    return ["+callbacks.sig._target_=signaller.SignalAtStep", f"+callbacks.sig.step={step}",
            f"+callbacks.sig.signum={signum}"]



@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_metrics_and_the_printed_command_resumes_exactly(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    run_cli(["fit", *COMMON], cwd=tmp_path, env={**ENV, "LIT_AMP_DET_RUNS": str(straight)})

    runs = tmp_path / "interrupted"
    env = {**ENV, "LIT_AMP_DET_RUNS": str(runs)}
    stopped = run_cli(["fit", *COMMON, *_signal_at(3, "SIGINT")], cwd=tmp_path, env=env, check=False)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    (run_dir,) = (runs / "fit").iterdir()
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 4  # the step in progress completed, then the save
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "interrupted" and metrics["interrupted_by"] == "SIGINT"
    assert metrics["global_step"] == 4 and "train/loss" in metrics["metrics"]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"
    assert "stopped by SIGINT; checkpoint saved at step 4" in stopped.stdout
    assert "Detected KeyboardInterrupt" not in stopped.stdout + stopped.stderr
    (line,) = [ln for ln in stopped.stdout.splitlines() if "resume with: " in ln]
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[:4] == ["python", "-m", "lit_amp_det", "fit"] and f"ckpt_path={run_dir.resolve()}" in command

    resumed = run_cli(command[3:], cwd=tmp_path, env=env)  # the printed command, as printed
    assert f"resuming {run_dir.resolve() / 'checkpoints' / 'last.ckpt'} (step 4" in resumed.stdout
    (final_dir,) = [p for p in (runs / "fit").iterdir() if p != run_dir]
    assert json.loads((final_dir / "metrics.json").read_text())["global_step"] == 8
    (straight_dir,) = (straight / "fit").iterdir()
    assert_same_last_weights(straight_dir, final_dir)


@pytest.mark.slow
def test_sigterm_saves_and_exits_with_143(tmp_path: Path) -> None:
    stopped = run_cli(["fit", *SMOKE, "trainer.max_epochs=1", *_signal_at(1, "SIGTERM")], cwd=tmp_path, env=ENV,
                      check=False)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "fit").iterdir()
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)["global_step"] == 2
    assert json.loads((run_dir / "metrics.json").read_text())["interrupted_by"] == "SIGTERM"
    assert "stopped by SIGTERM" in (run_dir / "fit.log").read_text()

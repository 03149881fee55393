"""Ctrl-C and SIGTERM mid-fit: a checkpoint and the metrics so far are saved, the resume command printed and
exact.
"""

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
    return [
        "+callbacks.sig._target_=signaller.SignalAtStep",
        f"+callbacks.sig.step={step}",
        f"+callbacks.sig.signum={signum}",
    ]


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_metrics_and_the_printed_command_resumes_exactly(
    tmp_path: Path,
) -> None:
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
    assert (
        command[:4] == ["python", "-m", "lit_amp_det", "fit"] and f"ckpt_path={run_dir.resolve()}" in command
    )

    resumed = run_cli(command[3:], cwd=tmp_path, env=env)  # the printed command, as printed
    assert f"resuming {run_dir.resolve() / 'checkpoints' / 'last.ckpt'} (step 4" in resumed.stdout
    (final_dir,) = [p for p in (runs / "fit").iterdir() if p != run_dir]
    assert json.loads((final_dir / "metrics.json").read_text())["global_step"] == 8
    (straight_dir,) = (straight / "fit").iterdir()
    assert_same_last_weights(straight_dir, final_dir)


@pytest.mark.slow
def test_sigterm_saves_and_exits_with_143(tmp_path: Path) -> None:
    stopped = run_cli(
        ["fit", *SMOKE, "trainer.max_epochs=1", *_signal_at(1, "SIGTERM")], cwd=tmp_path, env=ENV, check=False
    )
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs" / "fit").iterdir()
    assert (
        torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)[
            "global_step"
        ]
        == 2
    )
    assert json.loads((run_dir / "metrics.json").read_text())["interrupted_by"] == "SIGTERM"
    assert "stopped by SIGTERM" in (run_dir / "fit.log").read_text()


@pytest.mark.slow
def test_a_second_ctrl_c_exits_at_once_and_leaves_the_last_checkpoint_as_it_was(tmp_path: Path) -> None:
    env = {**ENV, "LIT_AMP_DET_RUNS": str(tmp_path / "runs")}
    twice = [
        "+callbacks.sig._target_=signaller.SignalAtStep",
        "+callbacks.sig.step=2",
        "+callbacks.sig.times=2",
        "callbacks.last_checkpoint.every_n_train_steps=1",
    ]
    stopped = run_cli(["fit", *COMMON, *twice], cwd=tmp_path, env=env, check=False)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "SIGINT received again: stopped at once" in stopped.stdout + stopped.stderr
    (run_dir,) = (tmp_path / "runs" / "fit").iterdir()
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 2  # the save of step 2; the step in progress was not saved
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))


@pytest.mark.slow
def test_sigterm_during_validation_stops_within_seconds_with_a_resumable_checkpoint(tmp_path: Path) -> None:
    """A 200-image validation is not waited for: the batch in progress ends, the training state is saved, exit
    143; ``fit ckpt_path=last`` then finishes the run.
    """
    import time

    runs, stamp = tmp_path / "runs", tmp_path / "signalled_at"
    env = {**ENV, "LIT_AMP_DET_RUNS": str(runs)}
    long_validation = [
        "data.val_size=200",
        "data.eval_batch_size=2",
        "trainer.max_epochs=2",
        "trainer.check_val_every_n_epoch=1",
        "+callbacks.sig._target_=signaller.SignalAtValidationBatch",
        "+callbacks.sig.batch=1",
        f"+callbacks.sig.stamp={stamp}",
    ]
    stopped = run_cli(["fit", *COMMON, *long_validation], cwd=tmp_path, env=env, check=False)
    ended = time.time()
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert ended - float(stamp.read_text()) < 10
    (run_dir,) = (runs / "fit").iterdir()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == 4  # the first epoch's 4 steps: the state validation began with
    resumed = run_cli(
        [
            "fit",
            *COMMON,
            "data.val_size=200",
            "data.eval_batch_size=2",
            "trainer.max_epochs=2",
            "trainer.check_val_every_n_epoch=1",
            "ckpt_path=last",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert "resuming " in resumed.stdout
    newest = max((runs / "fit").glob("*/metrics.json"), key=lambda p: p.stat().st_mtime)
    metrics = json.loads(newest.read_text())
    assert metrics["global_step"] == 8 and metrics["status"] == "finished"

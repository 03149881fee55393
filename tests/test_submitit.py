"""Sweeps through submitit's local executor (``hydra/launcher=submitit_local``): every job a process of its
own, the jobs that can finish finish, the sweep summary lists them all, and a failed job is named with its
overrides, its error and its submitit logs. One sweep checks it all: each job is a fresh Python process (torch
and Lightning imported again), the slow part on a 2-core machine.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from conftest import SMOKE, run_cli
from lit_amp_det.app.sweep import FAILURE_FILE

pytestmark = pytest.mark.slow

# 2 training steps, 1 validation batch, no loggers or callbacks
TINY = [
    *SMOKE,
    "logger=none",
    "callbacks=none",
    "data.train_size=8",
    "data.val_size=4",
    "trainer.max_epochs=1",
]


def test_submitit_sweep_finishes_the_good_jobs_and_names_the_failed_one_with_its_log(tmp_path: Path) -> None:
    """``fp16`` is not a precision: job 2 stops as it starts (the config check); jobs 0 and 1 train (``auto``:
    the CPU's fast precision, bf16-mixed where it computes bf16 natively, else 32-true).
    """
    proc = run_cli(
        ["fit", "-m", "hydra/launcher=submitit_local", "trainer.precision=32-true,auto,fp16", *TINY],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    (sweep,) = (tmp_path / "runs" / "multirun").iterdir()
    for job in ("0", "1"):
        metrics = json.loads((sweep / job / "metrics.json").read_text())
        assert metrics["status"] == "finished" and metrics["global_step"] == 2
        assert 0.0 <= metrics["metrics"]["val/segm_mAP"] <= 1.0
    assert not (sweep / "2" / "metrics.json").exists()
    assert not (tmp_path / "runs" / "fit").exists(), "a sweep's jobs write into the sweep folder only"
    logs = sorted(
        sweep.glob(".submitit/*/*_0_log.out")
    )  # one submitit job (process, folder, logs) per sweep job
    assert len(logs) == 3 and len({p.parent for p in logs}) == 3

    error = "ValueError: trainer.precision='fp16'; choose one of auto, 32-true,"
    failure = (sweep / "2" / FAILURE_FILE).read_text()
    assert failure.startswith(error)
    named = re.search(r"^submitit log: (\S+) (\S+)$", failure, re.MULTILINE)
    assert named, failure
    err_log, out_log = Path(named[1]), Path(named[2])
    assert err_log.parent.parent == sweep / ".submitit" and err_log.name.endswith("_0_log.err")
    assert out_log == err_log.with_suffix(".out") and out_log in logs
    err_text = err_log.read_text()  # the whole traceback, which the sweep's own process never gets
    assert (
        "Traceback (most recent call last)" in err_text
        and "in check_config" in err_text
        and error in err_text
    )

    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [(r["job"], r["status"], r["trainer.precision"]) for r in rows] == [
        ("0", "ok", "32-true"),
        ("1", "ok", "auto"),
        ("2", "failed", "fp16"),
    ]
    assert rows[2]["error"] == failure.strip() and rows[0]["error"] == rows[1]["error"] == ""
    assert "3 jobs (2 ok, 1 failed)" in proc.stdout and "| 2 | failed | fp16 |" in proc.stdout
    assert f"sweep summary: {sweep}/summary.{{csv,md,png}}" in proc.stdout
    # stderr ends naming the failed job: number, overrides, error, logs; the jobs that finished are not named
    report = proc.stderr[proc.stderr.index("sweep job 2 failed") :]
    assert report.startswith(f"sweep job 2 failed ({rows[2]['overrides']}):\n  {error}")
    assert "trainer.precision=fp16" in rows[2]["overrides"] and f"submitit log: {err_log} {out_log}" in report
    assert "sweep job 0" not in proc.stderr and "sweep job 1" not in proc.stderr

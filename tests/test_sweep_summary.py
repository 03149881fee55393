"""The sweep summary: rows from fabricated job directories, the callback, the Optuna config, real sweeps."""

from __future__ import annotations

import csv
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

from conftest import SMOKE, run_cli
from lit_amp_det.app.config import config_dir
from lit_amp_det.app.sweep import FAILURE_FILE, SweepSummary, collect_rows, summarize_sweep

METRIC = "val/segm_mAP"
COMMON = ["experiment=smoke", "command=fit"]
GRID = [("32-true", "none"), ("32-true", "fast"), ("bf16-mixed", "none"), ("bf16-mixed", "fast")]


def _metrics(job: int) -> dict[str, float]:
    values = {"train/loss": 2.0 - job}
    for kind in ("bbox", "segm"):
        for suffix in ("", "_50", "_75", "_small", "_medium", "_large"):
            values[f"val/{kind}_mAP{suffix}"] = round(0.1 * (job + 1) + (0.01 if kind == "segm" else 0.0), 4)
    return values


def _perf(job: int) -> dict[str, Any]:
    return {
        "device": "cpu",
        "train_images_per_s": 10.0 + job,
        "train_step_ms_median": 400.0 - job,
        "peak_memory_mb": 800.0 + 10 * job,
        "step_memory_mb": 100.0 + job,
        "tensor_memory_mb": 50.0 + job,
        "timed_steps": 6,
    }


def _job(sweep: Path, num: int, overrides: list[str], record: dict[str, Any] | str | None) -> Path:
    job_dir = sweep / str(num)
    (job_dir / ".hydra").mkdir(parents=True)
    (job_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if isinstance(record, dict):
        (job_dir / "metrics.json").write_text(json.dumps(record))
    elif isinstance(record, str):
        (job_dir / "metrics.json").write_text(record)
    return job_dir


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """Jobs 0-3: the precision x callbacks grid (job 3 an old run without ``perf`` or mAP); 4: no
    metrics.json; 5: truncated metrics.json; 10: a job that raised (numbered 10 to check numeric order).
    """
    sweep = tmp_path / "multirun" / "2026-01-01_00-00-00"
    for num, (precision, callbacks) in enumerate(GRID):
        record: dict[str, Any] = {
            "command": "fit",
            "metrics": _metrics(num),
            "time_s": 10.0 + num,
            "global_step": 8,
            "epoch": 1,
            "perf": _perf(num),
        }
        if num == 3:
            record = {"command": "fit", "metrics": {"train/loss": 1.0}, "time_s": 13.0}
        _job(sweep, num, [*COMMON, f"trainer.precision={precision}", f"callbacks={callbacks}"], record)
    _job(sweep, 4, [*COMMON, "trainer.precision=16-mixed", "callbacks=none"], None)
    _job(sweep, 5, [*COMMON, "trainer.precision=16-mixed", "callbacks=fast"], '{"command": "fit", "metr')
    failed = _job(sweep, 10, [*COMMON, "trainer.precision=16-mixed", "+callbacks.extra=1"], None)
    (failed / FAILURE_FILE).write_text("RuntimeError: CUDA out of memory\n")
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    (sweep / "notes").mkdir()  # neither .hydra/ nor metrics.json: not a job
    return sweep


def _is_nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def test_rows_have_status_overrides_metrics_and_perf(sweep: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lit_amp_det.app.sweep"):
        rows = collect_rows(sweep, METRIC)
    assert [r["job"] for r in rows] == [0, 1, 2, 3, 4, 5, 10]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "ok", "missing", "unreadable", "failed"]
    unreadable = [rec.getMessage() for rec in caplog.records if "unreadable" in rec.getMessage()]
    assert len(unreadable) == 1 and str(sweep / "5" / "metrics.json") in unreadable[0]

    columns = list(rows[0])
    assert columns[:5] == ["job", "status", "overrides", "experiment", "command"]
    assert columns[5:8] == ["trainer.precision", "callbacks", "callbacks.extra"]  # leading + dropped
    assert columns[8] == "objective" and "val/segm_mAP_large" in columns and "train/loss" not in columns
    assert columns[-8:] == [
        "images_per_s",
        "step_ms",
        "peak_memory_mb",
        "step_memory_mb",
        "tensor_memory_mb",
        "device",
        "time_s",
        "error",
    ]
    assert all(list(r) == columns for r in rows)

    first = rows[0]
    assert first["overrides"] == "experiment=smoke command=fit trainer.precision=32-true callbacks=none"
    assert (first["trainer.precision"], first["callbacks"], first["callbacks.extra"]) == (
        "32-true",
        "none",
        "",
    )
    assert first["objective"] == first["val/segm_mAP"] == 0.11 and first["val/bbox_mAP_50"] == 0.1
    assert (first["images_per_s"], first["step_ms"], first["peak_memory_mb"]) == (10.0, 400.0, 800.0)
    assert first["step_memory_mb"] == 100.0 and first["tensor_memory_mb"] == 50.0
    assert (first["device"], first["time_s"], first["error"]) == ("cpu", 10.0, "")
    assert rows[2]["objective"] == 0.31 and rows[2]["peak_memory_mb"] == 820.0

    old = rows[3]  # no perf, no validation: NaN, not a crash
    assert old["status"] == "ok" and old["time_s"] == 13.0
    for key in ("objective", "val/segm_mAP", "images_per_s", "step_ms", "peak_memory_mb"):
        assert _is_nan(old[key]), key
    assert "no metrics.json" in rows[4]["error"] and _is_nan(rows[4]["objective"])
    assert rows[5]["error"].startswith("metrics.json: ")
    assert rows[6]["error"] == "RuntimeError: CUDA out of memory" and rows[6]["callbacks.extra"] == "1"


def test_summary_files_csv_markdown_png(sweep: Path) -> None:
    rows = summarize_sweep(sweep, METRIC)
    with (sweep / "summary.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        table = list(reader)
    assert reader.fieldnames == list(rows[0]) and len(table) == 7
    assert [r["status"] for r in table] == ["ok", "ok", "ok", "ok", "missing", "unreadable", "failed"]
    assert {(r["trainer.precision"], r["callbacks"]) for r in table[:4]} == set(GRID)
    assert float(table[1]["objective"]) == 0.21 and float(table[1]["images_per_s"]) == 11.0
    assert table[3]["objective"] == table[3]["images_per_s"] == ""  # NaN is an empty cell

    md = (sweep / "summary.md").read_text()
    assert f"`{sweep}`" in md and "objective = `val/segm_mAP`" in md
    assert "7 jobs (4 ok, 1 failed, 1 missing, 1 unreadable)" in md
    assert "Highest `val/segm_mAP`: 0.3100, job #2 precision=bf16-mixed callbacks=none." in md
    assert "Overrides shared by all jobs: `experiment=smoke` `command=fit`" in md
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| job |"))
    assert header.startswith("| job | status | trainer.precision | callbacks | callbacks.extra | objective |")
    assert "val/segm_mAP_50" in header and "_small" not in header and "| error |" in header
    assert "| 0 | ok | 32-true | none |  | 0.1100 |" in md
    assert "| 1 | ok | 32-true | fast |  | 0.2100 |" in md
    # job 0: images/s, step ms, peak MB, step MB, tensor MB, time, no error
    assert "| 10.0 | 400.0 | 800 | 100 | 50 | 10.0 |  |" in md
    assert "compare settings by `tensor_memory_mb`" in md  # CPU jobs: the order-free memory figure
    assert "| 10 | failed | 16-mixed |  | 1 |" in md and "RuntimeError: CUDA out of memory" in md

    png = (sweep / "summary.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert not list(sweep.glob(".summary*")), "temporary files left behind"


def test_no_matplotlib_skips_the_png_with_one_warning(
    sweep: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it looks like
    with caplog.at_level(logging.WARNING, logger="lit_amp_det.app.sweep"):
        summarize_sweep(sweep, METRIC)
    assert (sweep / "summary.csv").is_file() and not (sweep / "summary.png").exists()
    assert sum("matplotlib is not installed" in rec.getMessage() for rec in caplog.records) == 1


def test_missing_sweep_dir_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"sweep directory .*nowhere"):
        summarize_sweep(tmp_path / "nowhere", METRIC)


def test_callback_writes_and_prints_at_multirun_end(sweep: Path, capsys: pytest.CaptureFixture) -> None:
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}, "optimized_metric": METRIC})
    SweepSummary().on_multirun_end(config=config, config_name="config")
    out = capsys.readouterr().out
    assert f"sweep summary: {sweep}/summary.{{csv,md,png}}" in out and "| 2 | ok | bf16-mixed | none |" in out
    assert len(list(csv.DictReader((sweep / "summary.csv").open()))) == 7
    assert (sweep / "summary.md").is_file() and (sweep / "summary.png").is_file()


def test_callback_never_raises_at_the_end_of_a_sweep(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = OmegaConf.create(
        {"hydra": {"sweep": {"dir": str(tmp_path / "gone")}}, "optimized_metric": METRIC}
    )
    with caplog.at_level(logging.WARNING, logger="lit_amp_det.app.sweep"):
        SweepSummary().on_multirun_end(config=config)
    assert any(
        "gone" in rec.getMessage() and "FileNotFoundError" in rec.getMessage() for rec in caplog.records
    )


def _job_config(sweep: Path, job_dir: Path, mode: RunMode) -> Any:
    return OmegaConf.create(
        {
            "hydra": {"mode": mode, "sweep": {"dir": str(sweep)}, "runtime": {"output_dir": str(job_dir)}},
            "optimized_metric": METRIC,
        }
    )


def _failed(error: Exception) -> JobReturn:
    job_return = JobReturn(status=JobStatus.FAILED)
    job_return.return_value = error
    return job_return


def test_failed_job_is_recorded_and_summarised_at_once(sweep: Path, capsys: pytest.CaptureFixture) -> None:
    job_dir = _job(sweep, 11, [*COMMON, "trainer.precision=16-mixed", "callbacks=default"], None)
    SweepSummary().on_job_end(
        config=_job_config(sweep, job_dir, RunMode.MULTIRUN),
        job_return=_failed(ValueError("trainer.precision='fp16'")),
    )
    assert (job_dir / FAILURE_FILE).read_text() == "ValueError: trainer.precision='fp16'\n"
    table = list(csv.DictReader((sweep / "summary.csv").open()))
    assert (table[-1]["job"], table[-1]["status"]) == ("11", "failed")
    assert "trainer.precision='fp16'" in table[-1]["error"]
    captured = capsys.readouterr()
    assert "(jobs so far: 8)" in captured.out and "Error executing job" not in captured.err


def test_single_runs_are_left_alone(sweep: Path) -> None:
    job_dir = _job(sweep, 12, COMMON, None)
    SweepSummary().on_job_end(
        config=_job_config(sweep, job_dir, RunMode.RUN), job_return=_failed(ValueError("x"))
    )
    assert not (job_dir / FAILURE_FILE).exists() and not (sweep / "summary.csv").exists()


def _compose(overrides: list[str]) -> Any:
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def test_default_config_registers_the_callback_and_keeps_the_basic_sweeper() -> None:
    cfg = _compose([])
    assert cfg.hydra.callbacks.sweep_summary._target_ == "lit_amp_det.app.sweep.SweepSummary"
    assert cfg.hydra.sweeper._target_.endswith("BasicSweeper") and cfg.hydra.mode is None


def test_optuna_search_config_composes() -> None:
    cfg = _compose(["hparams_search=optuna"])
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_ == "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    assert cfg.hydra.mode == RunMode.MULTIRUN and sweeper.direction == "maximize"
    assert sweeper.sampler._target_ == "optuna.samplers.TPESampler" and sweeper.sampler.seed is not None
    assert (sweeper.n_trials, sweeper.n_jobs) == (20, 1)
    assert sweeper.params["optim.optimizer.lr"] == "tag(log, interval(1e-4, 3e-3))"
    assert {"trainer.precision", "model.rpn.nms_thresh", "optim.optimizer.weight_decay"} <= set(
        sweeper.params
    )
    assert cfg.optimized_metric == METRIC  # kept from config.yaml
    assert cfg.hydra.callbacks.sweep_summary._target_ == "lit_amp_det.app.sweep.SweepSummary"


# Every job as short as metrics.json's perf allows: 4 training steps (RunStats leaves 2 out as warm-up,
# so fewer would record no speed or memory), 1 validation batch, no loggers.
TINY = [*SMOKE, "logger=none", "data.train_size=16", "data.val_size=4", "trainer.max_epochs=1"]


def _only_sweep_dir(tmp_path: Path) -> Path:
    (sweep,) = (tmp_path / "runs" / "multirun").iterdir()
    return sweep


@pytest.mark.slow
def test_multirun_writes_the_summary(tmp_path: Path) -> None:
    # (callbacks=fast would add its baseline-comparison steps to every other job; freeze_norm is a cheap
    # second value)
    proc = run_cli(
        ["fit", "-m", "trainer.precision=32-true,bf16-mixed", "callbacks=none,freeze_norm", *TINY],
        cwd=tmp_path,
    )
    sweep = _only_sweep_dir(tmp_path)
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    assert f"sweep summary: {sweep}/summary.{{csv,md,png}}" in proc.stdout
    table = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [r["status"] for r in table] == ["ok"] * 4
    assert {(r["trainer.precision"], r["callbacks"]) for r in table} == {
        (precision, callbacks)
        for precision in ("32-true", "bf16-mixed")
        for callbacks in ("none", "freeze_norm")
    }
    for row in table:
        assert 0.0 <= float(row["objective"]) <= 1.0 and row["objective"] == row["val/segm_mAP"]
        assert float(row["images_per_s"]) > 0 and float(row["peak_memory_mb"]) > 0 and row["device"] == "cpu"
    md = (sweep / "summary.md").read_text()
    assert "4 jobs (4 ok)" in md and "| trainer.precision | callbacks |" in md
    assert (sweep / "summary.png").read_bytes().startswith(b"\x89PNG")

    # the same settings in the opposite order: the tensor total of each setting does not move (the
    # resident-set peak does: each later job starts on what earlier ones left in the process)
    run_cli(
        ["fit", "-m", "trainer.precision=bf16-mixed,32-true", "callbacks=none", *TINY],
        cwd=tmp_path,
        env={"LIT_AMP_DET_RUNS": str(tmp_path / "reversed")},
    )
    (reversed_sweep,) = (tmp_path / "reversed" / "multirun").iterdir()
    forward = {
        r["trainer.precision"]: float(r["tensor_memory_mb"]) for r in table if r["callbacks"] == "none"
    }
    backward = {
        r["trainer.precision"]: float(r["tensor_memory_mb"])
        for r in csv.DictReader((reversed_sweep / "summary.csv").open())
    }
    assert forward == backward and forward["32-true"] > 0


@pytest.mark.slow
def test_optuna_trials_end_in_the_summary(tmp_path: Path) -> None:
    run_cli(
        ["fit", "hparams_search=optuna", "hydra.sweeper.n_trials=2", "trainer.precision=32-true", *TINY],
        cwd=tmp_path,
    )
    sweep = _only_sweep_dir(tmp_path)
    results = OmegaConf.load(sweep / "optimization_results.yaml")
    assert set(results.best_params) == {
        "optim.optimizer.lr",
        "optim.optimizer.weight_decay",
        "model.rpn.nms_thresh",
    }  # a fixed value on the command line wins
    table = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [r["status"] for r in table] == ["ok", "ok"]
    for row in table:
        assert 1e-4 <= float(row["optim.optimizer.lr"]) <= 3e-3 and row["trainer.precision"] == "32-true"
    assert max(float(r["objective"]) for r in table) == pytest.approx(results.best_value)
    assert (sweep / "summary.png").is_file()

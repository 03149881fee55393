"""The console a user reads: the package's lines, not third-party chatter (issue 43, point 1)."""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import SMOKE, run_cli
from lit_amp_det.app.console import quiet_console
from lit_amp_det.callbacks.console_log import ConsoleLog

CHATTER = ("faster_coco_eval", "Average Precision", "LeafSpec", "Tip:", "not supported by the model summary")


@pytest.mark.slow
def test_a_piped_fit_prints_its_own_lines_and_keeps_the_tables_in_the_log_file(tmp_path: Path) -> None:
    """Piped (not a terminal): a line after the first step; each validation adds at most 3 lines; COCO's
    tables, tips and internal warnings stay off the console but the log file has the tables; ``verbose=true``
    shows them.
    """
    quiet = run_cli(
        ["fit", *SMOKE, "trainer.max_epochs=2", "trainer.check_val_every_n_epoch=1"], cwd=tmp_path
    )
    console = quiet.stdout + quiet.stderr
    assert not [word for word in CHATTER if word in console], console
    lines = console.splitlines()
    assert any(" - step 1  epoch 0  loss " in line for line in lines), console
    first_validation = next(i for i, line in enumerate(lines) if "validation after epoch 0" in line)
    second_validation = next(i for i, line in enumerate(lines) if "validation after epoch 1" in line)
    assert second_validation - first_validation <= 3 + 2, lines[
        first_validation:second_validation
    ]  # 2 step lines
    (log_file,) = (tmp_path / "runs" / "fit").glob("*/fit.log")
    assert "Average Precision" in log_file.read_text()
    loud = run_cli(["fit", *SMOKE, "trainer.max_epochs=1", "verbose=true"], cwd=tmp_path)
    assert "Average Precision" in loud.stdout + loud.stderr


def test_quiet_console_filters_console_handlers_only(monkeypatch, tmp_path: Path) -> None:
    root = logging.getLogger()
    console, log_file = logging.StreamHandler(), logging.FileHandler(tmp_path / "fit.log")
    monkeypatch.setattr(root, "handlers", [console, log_file])
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    quiet_console()
    quiet_console()  # idempotent: one filter
    assert len(console.filters) == 1 and not log_file.filters
    table = logging.LogRecord(
        "faster_coco_eval.core.cocoeval", logging.INFO, __file__, 1, "Average Precision", None, None
    )
    ours = logging.LogRecord("lit_amp_det.progress", logging.INFO, __file__, 1, "step 1", None, None)
    assert not console.filter(table) and console.filter(ours) and log_file.filter(table)
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(
            "`isinstance(treespec, LeafSpec)` is deprecated, use ...", DeprecationWarning, stacklevel=1
        )
        warnings.warn("a warning of the user's own", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a warning of the user's own"]


def test_console_log_writes_after_the_first_step_then_by_steps_or_seconds(monkeypatch) -> None:
    callback = ConsoleLog(every_n_steps=50, console=True, every_n_seconds=60)
    written: list[str] = []
    monkeypatch.setattr(callback, "_write", written.append)
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    trainer = SimpleNamespace(global_step=0, max_steps=-1, world_size=1, current_epoch=0, callback_metrics={})
    callback.on_train_start(trainer, None)
    for step, seconds in [(1, 5), (2, 5), (3, 30), (4, 31), (5, 1), (50, 1)]:
        trainer.global_step, clock[0] = step, clock[0] + seconds
        callback.on_train_batch_end(trainer, None, None, [[], []], step)
    assert [line.split("  ")[0] for line in written] == ["step 1", "step 4", "step 50"]
    with pytest.raises(ValueError, match=r"every_n_seconds=0\b"):
        ConsoleLog(every_n_seconds=0)


# ---------------------------------------------------------------------------------------- errors (issue 43,
# point 2)
def test_a_bad_setting_prints_one_message_and_keeps_the_traceback_in_the_log_file(tmp_path: Path) -> None:
    failed = run_cli(
        ["fit", *SMOKE, "data.batch_size=0"], cwd=tmp_path, env={"HYDRA_FULL_ERROR": "0"}, check=False
    )
    assert failed.returncode == 1 and "Traceback" not in failed.stderr + failed.stdout
    assert failed.stderr.strip().splitlines()[-1] == "lit_amp_det: data.batch_size=0 must be an integer >= 1"
    (log_file,) = (tmp_path / "runs" / "fit").glob("*/fit.log")
    assert "Traceback" in log_file.read_text() and "data.batch_size=0 must be" in log_file.read_text()


def test_a_misspelt_key_gets_the_closest_settings_in_a_few_lines(tmp_path: Path) -> None:
    failed = run_cli(["fit", "trainer.max_epoch=2"], cwd=tmp_path, env={"HYDRA_FULL_ERROR": "0"}, check=False)
    lines = failed.stderr.strip().splitlines()
    assert failed.returncode != 0 and len(lines) <= 5, failed.stderr
    assert lines[0].startswith(
        "lit_amp_det: trainer.max_epoch is not a setting. Did you mean trainer.max_epochs"
    )
    assert not (tmp_path / "runs").exists()  # stopped before Hydra made a run folder


def test_every_trainer_argument_is_a_setting_without_a_plus() -> None:
    from lit_amp_det.app.overrides import UnknownSetting, prepare_overrides

    assert prepare_overrides(["trainer.limit_val_batches=2", "trainer.max_epochs=3", "seed=1"]) == [
        "+trainer.limit_val_batches=2",
        "trainer.max_epochs=3",
        "seed=1",
    ]  # max_epochs is listed in conf/trainer
    assert prepare_overrides(["trainer.limit_val_batches=1,2"], multirun=True) == [
        "+trainer.limit_val_batches=1,2"
    ]
    with pytest.raises(UnknownSetting, match=r"data\.batchsize .*data\.batch_size\b"):
        prepare_overrides(["data.batchsize=3"])
    assert prepare_overrides(["model=no_such_model"]) == ["model=no_such_model"]  # Hydra lists the options


def test_a_fit_of_zero_steps_is_refused(tmp_path: Path) -> None:
    from conftest import compose_config
    from lit_amp_det.app.config import check_config

    for override in ("trainer.max_steps=0", "trainer.max_epochs=0"):
        with pytest.raises(ValueError, match=r"trainer\.max_(steps|epochs)=0\b"):
            check_config(compose_config([override], tmp_path))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.transform.min_size=0", "model.transform.min_size=0 must be an integer >= 1"),
        ("model.transform.min_size=[64,0]", "model.transform.min_size=[64, 0] must be an integer >= 1"),
        ("optim.optimizer.lr=abc", "optim.optimizer.lr='abc' must be a finite number > 0"),
        ("optim.optimizer.lr=nan", "optim.optimizer.lr=nan must be a finite number > 0"),
        ("data.batch_size=2.5", "data.batch_size=2.5 must be an integer >= 1"),
        ("data.num_workers=-1", "data.num_workers=-1 must be an integer >= 0"),
        ("data.train_size=0", "data.train_size=0 must be an integer >= 1"),
    ],
)
def test_numeric_settings_are_checked_naming_the_setting(tmp_path: Path, override: str, message: str) -> None:
    from conftest import compose_config
    from lit_amp_det.app.config import check_config

    with pytest.raises(ValueError) as err:
        check_config(compose_config([*SMOKE, override], tmp_path))
    assert str(err.value) == message


def test_bench_help_lists_the_benches_and_succeeds(capsys) -> None:
    from lit_amp_det.bench import BENCHMARKS, main

    main(["--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m lit_amp_det bench {") and all(name in out for name in BENCHMARKS)


def test_output_piped_into_a_reader_that_leaves_early_ends_without_a_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "lit_amp_det", "--help"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # `| head -0`: the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141) and "Traceback" not in err and "BrokenPipe" not in err, err

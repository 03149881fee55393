"""Run folders and ``ckpt_path``: unique folders, never reused, and ``last`` resuming only the run it
should.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, SMOKE, compose_config, run_cli
from lit_amp_det.app.runs import (
    ResumeError,
    read_run,
    resolve_ckpt_path,
    unique_dir,
    update_run_record,
    write_run_record,
)


# ------------------------------------------------------------------------------------------ unit level
def _fake_run(
    root: Path,
    name: str,
    *,
    status: str,
    overrides: list[str] = (),
    step: int | None = 3,
    started: float,
    resumed_from: str | None = None,
    pid: int | None = None,
) -> Path:
    """A run folder as a fit leaves it: run.json, config_resolved.yaml and (optionally)
    checkpoints/last.ckpt.
    """
    run_dir = root / "fit" / name
    run_dir.mkdir(parents=True)
    cfg = compose_config([*SMOKE, *overrides], output_dir=run_dir)
    OmegaConf.save(cfg, run_dir / "config_resolved.yaml", resolve=True)
    write_run_record(run_dir, "fit", resumed_from=resumed_from)
    record = json.loads((run_dir / "run.json").read_text())
    record.update(status=status, started=started, pid=pid if pid is not None else record["pid"])
    (run_dir / "run.json").write_text(json.dumps(record))
    if step is not None:
        (run_dir / "checkpoints").mkdir()
        torch.save({"global_step": step, "epoch": 0}, run_dir / "checkpoints" / "last.ckpt")
    return run_dir


def _resolve(root: Path, ckpt_path: str, overrides: list[str] = (), command: str = "fit") -> str | None:
    me = root / command / "now"
    cfg = compose_config([*SMOKE, *overrides, f"ckpt_path={ckpt_path}", f"command={command}"], output_dir=me)
    return resolve_ckpt_path(cfg, me, root)


def test_unique_dir_never_hands_out_an_existing_folder(tmp_path: Path) -> None:
    base = tmp_path / "runs" / "fit" / "2026-11-23_10-00-00"
    got = [unique_dir(str(base)) for _ in range(3)]
    assert got == [str(base), f"{base}_1", f"{base}_2"]
    assert all(Path(p).is_dir() for p in got)


def test_last_resumes_the_newest_killed_run_not_an_older_finished_one(tmp_path: Path, caplog) -> None:
    root = tmp_path / "runs"
    _fake_run(root, "a", status="finished", overrides=["data.train_size=12"], step=8, started=1.0)
    killed = _fake_run(root, "b", status="running", step=2, started=2.0, pid=2**22 + 17)  # no such process
    assert read_run(killed).status == "killed"
    with caplog.at_level("INFO", logger="lit_amp_det.app.runs"):
        assert _resolve(root, "last") == str((killed / "checkpoints" / "last.ckpt").resolve())
    assert "resuming" in caplog.text and "step 2" in caplog.text and str(killed.resolve()) in caplog.text


def _newest_fit(root: Path, case: str) -> tuple[Path, subprocess.Popen | None]:
    """The newest fit under ``root``, one that ``last`` cannot resume for the reason ``case``."""
    if case == "finished":
        return _fake_run(root, "b", status="finished", step=8, started=2.0), None
    if case == "other_data":
        return _fake_run(root, "b", status="interrupted", overrides=["data.train_size=12"], started=2.0), None
    if case == "no_checkpoint":
        return _fake_run(root, "b", status="failed", step=None, started=2.0), None
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return _fake_run(root, "b", status="running", started=2.0, pid=sleeper.pid), sleeper


CASES = ["finished", "other_data", "no_checkpoint", "still_running"]


@pytest.mark.parametrize("case", CASES)
def test_last_passes_over_newer_fits_it_cannot_resume(tmp_path: Path, case: str, caplog) -> None:
    """``fit ckpt_path=last`` is the newest unfinished fit with this model and data that saved a checkpoint: a
    newer finished, other, checkpoint-less (named in a log line) or running fit does not stand in its way.
    """
    root = tmp_path / "runs"
    older = _fake_run(root, "a", status="interrupted", step=2, started=1.0)
    newest, sleeper = _newest_fit(root, case)
    try:
        with caplog.at_level("INFO", logger="lit_amp_det.app.runs"):
            assert _resolve(root, "last") == str((older / "checkpoints" / "last.ckpt").resolve())
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
    assert ("saved no checkpoint: " + str(newest) in caplog.text) == (case == "no_checkpoint")


@pytest.mark.parametrize(
    ("case", "expected"),
    list(
        zip(
            CASES,
            [
                "finished: there is nothing to resume",
                "data.train_size: 12 -> 16",
                "before it saved a checkpoint",
                "is still running",
            ],
        )
    ),
)
def test_last_refuses_with_the_reason_and_the_folder(tmp_path: Path, case: str, expected: str) -> None:
    root = tmp_path / "runs"
    newest, sleeper = _newest_fit(root, case)
    try:
        with pytest.raises(ResumeError) as err:
            _resolve(root, "last")
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
    message = str(err.value)
    assert expected in message and str(newest.resolve()) in message
    if case == "finished":  # and how to train the finished one further, as Lightning continues a checkpoint
        assert f"ckpt_path={newest.resolve()} and a larger trainer.max_epochs" in message


@pytest.mark.parametrize("saved", ["fused_absent", "fused_null", "speedups_absent"])
def test_last_resumes_across_settings_that_give_the_same_run(tmp_path: Path, saved: str, caplog) -> None:
    """``optim.optimizer.fused`` and the ``speedups`` change how a step is computed, not its result: a run
    saved without the key (made before it existed) or with another value is still the run ``last`` resumes.
    """
    root = tmp_path / "runs"
    killed = _fake_run(
        root,
        "a",
        status="interrupted",
        started=1.0,
        overrides=["optim.optimizer.fused=null"] if saved == "fused_null" else [],
    )
    if saved.endswith("absent"):
        saved_config = OmegaConf.load(killed / "config_resolved.yaml")
        if saved == "fused_absent":
            for section in (saved_config.optim.optimizer, saved_config.model.optim.optimizer):
                del section["fused"]
        else:
            del saved_config["speedups"], saved_config.model["speedups"]
        OmegaConf.save(saved_config, killed / "config_resolved.yaml")
    with caplog.at_level("INFO", logger="lit_amp_det.app.runs"):
        assert _resolve(root, "last") == str((killed / "checkpoints" / "last.ckpt").resolve())
    said = {
        "fused_absent": "model.optim.optimizer.fused: None -> 'auto'",
        "fused_null": "model.optim.optimizer.fused: None -> 'auto'",
        "speedups_absent": (
            "model.speedups.ext_ops._target_: None -> 'lit_amp_det.models.speedups.ExtensionOps'"
        ),
    }
    assert said[saved] in caplog.text  # said, not refused
    with pytest.raises(
        ResumeError, match="model.optim.optimizer.lr"
    ):  # a setting that changes the run still counts
        _resolve(root, "last", ["optim.optimizer.lr=0.5"])


def test_last_resumes_under_other_implementation_settings(tmp_path: Path, caplog) -> None:
    """Kernels, memory formats, compilation and the evaluation settings change how a step is computed or
    scored, not the model, data or recipe (as ``trainer.precision``, which is not compared): a run killed on
    one machine resumes with another's ``speedups``, and from other ``model.weights`` (a resume restores every
    tensor).
    """
    root = tmp_path / "runs"
    killed = _fake_run(root, "a", status="interrupted", started=1.0)
    switches = [
        "speedups.channels_last={_target_:lit_amp_det.models.speedups.ChannelsLast}",
        "speedups.ext_ops=null",
        "speedups.compile={_target_:lit_amp_det.models.speedups.CompileBackbone,devices:[cuda]}",
        "model.evaluation.backend=pycocotools",
        "model.evaluation.mask_threshold=0.4",
        "optim.optimizer.fused=null",
        f"model.weights={tmp_path / 'other.ckpt'}",
    ]
    with caplog.at_level("INFO", logger="lit_amp_det.app.runs"):
        assert _resolve(root, "last", switches) == str((killed / "checkpoints" / "last.ckpt").resolve())
    for key in (
        "model.speedups.channels_last._target_: None -> 'lit_amp_det.models.speedups.ChannelsLast'",
        "model.speedups.ext_ops._target_: 'lit_amp_det.models.speedups.ExtensionOps' -> None",
        "model.speedups.compile.devices: None -> ['cuda']",
        "model.evaluation.mask_threshold: 0.5 -> 0.4",
        "model.evaluation.backend: 'faster_coco_eval' -> 'pycocotools'",
        "model.optim.optimizer.fused: 'auto' -> None",
    ):
        assert key in caplog.text
    assert "model.weights" not in caplog.text  # not even an implementation difference
    assert _resolve(root, "last", ["speedups=none"]) == str((killed / "checkpoints" / "last.ckpt").resolve())
    assert _resolve(root, "last", ["speedups=gpu"]) == str((killed / "checkpoints" / "last.ckpt").resolve())
    for changed in (
        "model.rpn.batch_size_per_image=64",
        "model.backbone.fpn_channels=16",
        "model.mask=false",
        "optim.reference_batch=16",
        "optim.scheduler.warmup_steps=5",
    ):
        with pytest.raises(
            ResumeError,
            match=changed.split("=")[0].replace("optim.", "model.optim.", 1)
            if changed.startswith("optim.")
            else changed.split("=")[0],
        ):
            _resolve(root, "last", [*switches, changed])  # the model and the recipe still count


def test_explicit_run_dir_and_resumed_chains(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    first = _fake_run(root, "a", status="interrupted", step=4, started=1.0)
    _fake_run(root, "b", status="finished", step=8, started=2.0)
    first_ckpt = str((first / "checkpoints" / "last.ckpt").resolve())
    assert _resolve(root, str(first)) == first_ckpt  # ckpt_path=RUN_DIR, whatever is newer
    # a run that resumed `first` and was killed before its own first save: resuming it continues first's
    # checkpoint
    _fake_run(root, "c", status="killed", step=None, started=3.0, resumed_from=first_ckpt)
    assert _resolve(root, "last") == first_ckpt
    # once a later run resumed it, `first` itself is no longer offered
    _fake_run(root, "d", status="finished", step=8, started=4.0, resumed_from=first_ckpt)
    with pytest.raises(ResumeError, match="finished") as err:
        _resolve(root, "last")
    assert "resume it with" not in str(err.value)


def test_last_for_evaluation_takes_the_newest_fit_with_the_same_model(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    older = _fake_run(
        root, "a", status="finished", step=8, started=1.0, overrides=["model.backbone.fpn_channels=16"]
    )
    newest = _fake_run(root, "b", status="finished", overrides=["data.train_size=12"], step=8, started=2.0)
    assert _resolve(root, "last", command="test") == str((newest / "checkpoints" / "last.ckpt").resolve())
    # a newer fit of another model does not stand in the way
    assert _resolve(root, "last", overrides=["model.backbone.fpn_channels=16"], command="predict") == str(
        (older / "checkpoints" / "last.ckpt").resolve()
    )
    with pytest.raises(
        ResumeError,
        match=r"model\.num_classes",
    ) as err:
        _resolve(root, "last", overrides=["model.num_classes=9"], command="validate")
    assert str(newest.resolve()) in str(err.value)


def test_last_for_evaluation_refuses_a_fit_without_its_saved_config(tmp_path: Path) -> None:
    fit = _fake_run(tmp_path / "runs", "a", status="finished", step=8, started=1.0)
    (fit / "config_resolved.yaml").unlink()
    with pytest.raises(ResumeError, match=r"config_resolved\.yaml"):
        _resolve(tmp_path / "runs", "last", command="test")


@pytest.mark.parametrize("command", ["validate", "test", "predict"])
def test_last_for_evaluation_takes_weights_across_settings_that_leave_them_usable(
    tmp_path: Path, command: str, caplog
) -> None:
    """Evaluating a fit's weights at another test size, score threshold, kernel or memory format is what one
    does with weights: only a setting that changes a tensor's name or shape makes them another model's.
    """
    root = tmp_path / "runs"
    fit = _fake_run(root, "a", status="finished", step=8, started=1.0)
    other = [
        "speedups.channels_last={_target_:lit_amp_det.models.speedups.ChannelsLast}",
        "speedups.ext_ops=null",
        "model.transform.min_size=96",
        "model.transform.max_size=96",
        "model.roi_heads.score_thresh=0.3",
        "model.rpn.post_nms_top_n_test=20",
        "model.evaluation.mask_threshold=0.4",
        "model.evaluation.backend=pycocotools",
    ]
    with caplog.at_level("INFO", logger="lit_amp_det.app.runs"):
        assert _resolve(root, "last", other, command=command) == str(
            (fit / "checkpoints" / "last.ckpt").resolve()
        )
    assert (
        "model.transform.min_size: 64 -> 96" in caplog.text and "model.roi_heads.score_thresh" in caplog.text
    )
    assert (
        "model.speedups.channels_last._target_: None -> 'lit_amp_det.models.speedups.ChannelsLast'"
        in caplog.text
    )
    for more in (["speedups=gpu"], ["speedups=none"], ["optim=sgd"]):
        assert _resolve(root, "last", more, command=command) == str(
            (fit / "checkpoints" / "last.ckpt").resolve()
        )


def test_run_record_updates_keep_the_rest(tmp_path: Path) -> None:
    write_run_record(tmp_path, "fit", resumed_from="/x/last.ckpt")
    update_run_record(tmp_path, status="finished", global_step=8)
    record = json.loads((tmp_path / "run.json").read_text())
    assert (
        record["status"] == "finished"
        and record["resumed_from"] == "/x/last.ckpt"
        and record["global_step"] == 8
    )


# ------------------------------------------------------------------------------------------- end to end
def test_an_earlier_run_folder_is_never_written_into(tmp_path: Path) -> None:
    used = tmp_path / "used"
    (used / "checkpoints").mkdir(parents=True)
    (used / "checkpoints" / "last.ckpt").write_bytes(b"earlier checkpoint")
    (used / "metrics.json").write_text('{"earlier": true}')
    proc = run_cli(["fit", *SMOKE, f"hydra.run.dir={used}"], cwd=tmp_path, check=False)
    assert (
        proc.returncode != 0 and "already holds a run" in proc.stderr and f"ckpt_path={used}" in proc.stderr
    )
    assert sorted(p.name for p in used.iterdir()) == ["checkpoints", "metrics.json"]  # not even .hydra/
    assert (used / "checkpoints" / "last.ckpt").read_bytes() == b"earlier checkpoint"


def _popen_fit(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "lit_amp_det", "fit", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_two_fits_started_together_get_their_own_folders_and_plain_text_logs(tmp_path: Path) -> None:
    # both ask for the same folder name, as two runs started in the same second do
    same_second = "hydra.run.dir=${unique_dir:" + str(tmp_path / "runs" / "fit" / "2026-11-23_10-00-00") + "}"
    common = [
        *SMOKE,
        "trainer.max_epochs=1",
        "trainer.check_val_every_n_epoch=1",
        same_second,
        "callbacks.console_log.every_n_steps=2",
    ]
    procs = [_popen_fit([*common, f"data.train_size={size}"], tmp_path) for size in (12, 16)]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    runs = sorted((tmp_path / "runs" / "fit").iterdir())
    assert [p.name for p in runs] == ["2026-11-23_10-00-00", "2026-11-23_10-00-00_1"]
    steps = set()
    for run_dir in runs:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        config = OmegaConf.load(run_dir / "config_resolved.yaml")
        size = config.data.train_size
        assert metrics["global_step"] == size // 4  # each folder holds its own run's metrics and config
        steps.add(metrics["global_step"])
        rows = (run_dir / "logs" / "metrics.csv").read_text().splitlines()
        loss_column = rows[0].split(",").index("train/loss")
        assert (
            sum(1 for row in rows[1:] if row.split(",")[loss_column]) == size // 4
        )  # no rows of the other run
        assert (
            torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)[
                "global_step"
            ]
            == size // 4
        )
        log_text = (run_dir / "fit.log").read_text()
        assert "step 2" in log_text and "lr " in log_text and "images/s" in log_text
        assert "validation after epoch 0" in log_text and "val/segm_mAP" in log_text
    assert steps == {3, 4}
    out = outputs[1][0]  # stdout is a pipe here: lines instead of a progress bar
    assert "step 2/" not in out and "step 2  epoch 0" in out and "validation after epoch 0" in out
    assert "Epoch 0:" not in out and "it/s" not in out
    assert "lr 0.000 " not in out


@pytest.mark.slow
def test_kill_9_then_last_resumes_that_run_and_not_a_finished_one(tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    fast = [*SMOKE, "trainer.max_epochs=1"]
    run_cli(["fit", *fast, "data.train_size=12"], cwd=tmp_path)  # an earlier, finished run on other data
    killed = run_cli(
        [
            "fit",
            *fast,
            "callbacks.last_checkpoint.every_n_train_steps=2",
            "+callbacks.killer._target_=killer.KillAtStep",
            "+callbacks.killer.step=3",
        ],
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert killed.returncode == -9
    (killed_ckpt,) = [
        p
        for p in (tmp_path / "runs").glob("fit/*/checkpoints/last.ckpt")
        if not (p.parent.parent / "metrics.json").exists()
    ]
    resumed = run_cli(["fit", *fast, "ckpt_path=last"], cwd=tmp_path)
    assert f"resuming {killed_ckpt.resolve()} (step 2" in resumed.stdout
    newest = max((tmp_path / "runs").glob("fit/*/metrics.json"), key=lambda p: p.stat().st_mtime)
    assert json.loads(newest.read_text())["global_step"] == 4
    assert json.loads((newest.parent / "run.json").read_text())["resumed_from"] == str(killed_ckpt.resolve())
    again = run_cli(["fit", *fast, "ckpt_path=last"], cwd=tmp_path, check=False)
    assert again.returncode != 0 and "finished: there is nothing to resume" in again.stderr


# ------------------------------------------------------------------------------------------ small things
def test_progress_bar_shows_the_learning_rate_readably(monkeypatch) -> None:
    from lightning.pytorch.callbacks import TQDMProgressBar

    from lit_amp_det.callbacks.console_log import ReadableProgressBar

    monkeypatch.setattr(
        TQDMProgressBar,
        "get_metrics",
        lambda self, trainer, module: {"train/lr": 0.000123, "train/loss": 0.5},
    )
    metrics = ReadableProgressBar().get_metrics(None, None)
    assert metrics == {"train/lr": "1.23e-04", "train/loss": 0.5}


def test_coco_loader_defaults_follow_the_device() -> None:
    cpu = compose_config(["data=coco", "data.root=/x", "trainer.accelerator=cpu"], output_dir=Path("/tmp/x"))
    assert cpu.data.pin_memory is False and cpu.data.num_workers == 4
    gpu = compose_config(["data=coco", "data.root=/x", "trainer=gpu"], output_dir=Path("/tmp/x"))
    assert gpu.data.pin_memory is True
    quick = compose_config(["trainer.max_steps=50", "data.predict_split=test"], output_dir=Path("/tmp/x"))
    assert (
        quick.trainer.max_steps == 50 and quick.data.predict_split == "test"
    )  # keys a user sets often exist


def test_loader_workers_are_clamped_where_the_data_is_loaded() -> None:
    """The config keeps what was asked (a SLURM job's ``cpus_per_task`` is sized from it on the submitting
    host); the data module starts no more workers than the CPUs its process may use.
    """
    from lit_amp_det.data import CocoDataModule
    from lit_amp_det.errors import ArgumentError

    usable = len(os.sched_getaffinity(0))
    assert CocoDataModule(root="/x", num_workers=usable + 3).loader_options["num_workers"] == usable
    assert CocoDataModule(root="/x", num_workers=0).loader_options["num_workers"] == 0
    with pytest.raises(ArgumentError, match="num_workers"):
        CocoDataModule(root="/x", num_workers=-1)


def test_a_resumed_folder_is_claimed_against_a_second_fit_and_loses_its_stale_temporaries(
    tmp_path: Path,
) -> None:
    from lit_amp_det.app import runs

    root = tmp_path / "runs"
    killed = _fake_run(root, "a", status="interrupted", step=2, started=1.0)
    stale = killed / "checkpoints" / ".last.ckpt.tmp"
    stale.write_bytes(b"half a checkpoint")  # what a SIGKILL during a save leaves
    lock = killed / "checkpoints" / ".resume.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            f"fd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'process 4242 on elsewhere')\n"
            "print('locked', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ResumeError, match=r"process 4242 on elsewhere"):
            _resolve(root, "last")
    finally:
        holder.kill()
        holder.wait()
    assert stale.exists()  # not touched while another process resumed it
    assert _resolve(root, "last") == str((killed / "checkpoints" / "last.ckpt").resolve())
    assert not stale.exists() and (killed / "checkpoints").resolve() in runs._CLAIMS
    assert _resolve(root, "last") == str(
        (killed / "checkpoints" / "last.ckpt").resolve()
    )  # this process again


def test_a_new_fit_removes_the_partial_checkpoints_of_killed_fits(tmp_path: Path) -> None:
    from lit_amp_det.app.runs import remove_stale_temporaries

    root = tmp_path / "runs"
    killed = _fake_run(root, "a", status="running", step=2, started=1.0, pid=2**22 + 17)  # no such process
    stopped = _fake_run(root, "b", status="interrupted", step=2, started=2.0)
    for run in (killed, stopped):
        (run / "checkpoints" / ".last.ckpt.tmp").write_bytes(b"half a checkpoint")
    remove_stale_temporaries(root)
    assert not (killed / "checkpoints" / ".last.ckpt.tmp").exists()
    assert (
        stopped / "checkpoints" / ".last.ckpt.tmp"
    ).exists()  # its process was not seen to die: left alone
    assert (killed / "checkpoints" / "last.ckpt").exists()


def test_a_run_saved_before_the_typed_settings_and_renames_is_the_same_run(tmp_path: Path) -> None:
    """A run's ``config_resolved.yaml`` from before the model's settings were typed (it lists only the keys
    the YAML gave) and before ``data.seed`` / ``data.data_seed`` were renamed is resumed by ``last``: what it
    left out ran at today's defaults, and the old names are read as the new ones.
    """
    root = tmp_path / "runs"
    run_dir = _fake_run(root, "old", status="running", step=2, started=1.0, pid=2**22 + 19)
    saved = OmegaConf.to_container(OmegaConf.load(run_dir / "config_resolved.yaml"))
    for typed_later in ("fg_iou_thresh", "bg_iou_thresh", "positive_fraction", "score_thresh"):
        del saved["model"]["rpn"][typed_later]
    del saved["model"]["roi_heads"]["sampling_ratio"]
    saved["data"]["seed"] = saved["data"].pop("sampler_seed")
    saved["data"]["data_seed"] = saved["data"].pop("generation_seed")
    OmegaConf.save(OmegaConf.create(saved), run_dir / "config_resolved.yaml")
    assert _resolve(root, "last") == str((run_dir / "checkpoints" / "last.ckpt").resolve())
    saved["model"]["rpn"]["score_thresh"] = 0.5  # a value the defaults do not give: another run
    OmegaConf.save(OmegaConf.create(saved), run_dir / "config_resolved.yaml")
    with pytest.raises(ResumeError, match=r"model\.rpn\.score_thresh"):
        _resolve(root, "last")

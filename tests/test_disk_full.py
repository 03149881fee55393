"""A full disk loses nothing already written (issue 43, point 4): checkpoints written in place and durably,
the partial file removed, the run's record kept up to date from the room it already holds.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from lit_amp_det import checkpoint_io
from lit_amp_det.app import runs
from lit_amp_det.app.console import report_user_error
from lit_amp_det.app.runs import update_run_record, write_run_record
from lit_amp_det.checkpoint_io import DiskFull, DurableCheckpointIO


class _FullFile:
    """A file that accepts ``room`` bytes, then raises ENOSPC (a disk that fills up during the write)."""

    def __init__(self, file, room: int) -> None:
        self.file, self.room = file, room

    def write(self, data) -> int:
        if len(data) > self.room:
            self.file.write(bytes(data[: self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def test_a_checkpoint_is_written_in_its_folder_and_renamed_over_the_old(tmp_path: Path, monkeypatch) -> None:
    io = DurableCheckpointIO()
    target = tmp_path / "checkpoints" / "last.ckpt"
    temp_folders: list[str] = []
    monkeypatch.setattr(
        "tempfile.mkstemp",
        lambda *a, **k: (
            temp_folders.append("used")
            or (_ for _ in ()).throw(AssertionError("no temporary copy elsewhere"))
        ),
    )
    synced: list[int] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or fsync(fd))
    io.save_checkpoint({"global_step": 3, "w": torch.ones(4)}, target)
    assert torch.load(target, weights_only=True)["global_step"] == 3
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"] and not temp_folders
    assert len(synced) == 2  # the file before the rename, the folder after it


def test_a_full_disk_keeps_the_previous_checkpoint_and_removes_the_partial_file(
    tmp_path: Path, monkeypatch
) -> None:
    io = DurableCheckpointIO()
    target = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.ones(4)}, target)
    before = target.read_bytes()
    # the writer closes the file it opened (as it closes open()'s), so no context manager here
    monkeypatch.setattr(
        checkpoint_io,
        "open",
        lambda path, mode: _FullFile(open(path, mode), 100),  # noqa: SIM115
        raising=False,
    )
    with pytest.raises(
        DiskFull,
        match=r"(?i)no space left.*last\.ckpt",
    ):
        io.save_checkpoint({"global_step": 2, "w": torch.ones(1000)}, target)
    monkeypatch.undo()
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_the_run_record_says_failed_on_a_full_disk(tmp_path: Path, monkeypatch, capsys) -> None:
    write_run_record(tmp_path, "fit")
    assert (tmp_path / "run.json").stat().st_size == runs.RESERVED_RECORD_BYTES  # room kept for later updates
    monkeypatch.setattr(
        Path,
        "write_bytes",
        lambda self, data: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")),
    )
    error = DiskFull(errno.ENOSPC, "no space left on the disk of x to save last.ckpt")
    update_run_record(tmp_path, status="failed", error=f"DiskFull: {error}")
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["status"] == "failed" and "no space left" in record["error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]  # no temporary file left behind
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    assert report_user_error(error) and "lit_amp_det: [Errno 28] no space left" in capsys.readouterr().err


def test_a_command_on_a_full_disk_says_why_it_cannot_start(tmp_path: Path, monkeypatch) -> None:
    from lit_amp_det import cli

    monkeypatch.setenv("LIT_AMP_DET_RUNS", str(tmp_path / "runs"))
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda path: _Usage(5 * 2**20))
    with pytest.raises(
        SystemExit,
        match=r"\b5 MB.*runs.*\b64 MB",
    ):
        cli.main(["fit"])
    assert not (tmp_path / "runs").exists()


class _Usage:
    def __init__(self, free: int) -> None:
        self.free = free


def test_training_curves_on_a_full_disk_leave_no_partial_picture(tmp_path: Path, monkeypatch) -> None:
    from matplotlib.figure import Figure

    from lit_amp_det.callbacks import TrainingCurves

    def full(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    curves = TrainingCurves(tmp_path / "training_curves.png")
    curves.history = {"train/loss": [[1, 2.0], [2, 1.5]]}
    monkeypatch.setattr(Figure, "savefig", full)
    with pytest.raises(OSError, match="No space left"):
        curves.write()
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 112 MB tmpfs: room for the smoke run and one 60 MB ``last.ckpt``, not for the next save beside it."""
    import shutil
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        shutil.which("mount") is None
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=112m", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("mounting a tmpfs is not permitted here (the ENOSPC wrappers above cover the same paths)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_a_fit_on_a_disk_too_small_for_the_next_checkpoint_stops_cleanly(
    small_disk: Path, tmp_path: Path
) -> None:
    from conftest import run_cli

    env = {"LIT_AMP_DET_RUNS": str(small_disk / "runs"), "HYDRA_FULL_ERROR": "0"}  # as a user sees it
    proc = run_cli(
        ["fit", "experiment=smoke", "callbacks.last_checkpoint.every_n_train_steps=2"],
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    message = [line for line in proc.stderr.splitlines() if line.startswith("lit_amp_det:")]
    assert len(message) == 1 and "no space left on the disk of" in message[0] and "last.ckpt" in message[0], (
        message
    )
    run_dir = next((small_disk / "runs" / "fit").iterdir())
    record = json.loads((run_dir / "run.json").read_text())
    assert record["status"] == "failed" and "no space left" in record["error"], record
    leftovers = [p.name for p in run_dir.rglob("*") if p.name.endswith(".tmp") or ".tmp." in p.name]
    assert not leftovers and [p.name for p in (run_dir / "checkpoints").iterdir()] == ["last.ckpt"]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    again = run_cli(["fit", "experiment=smoke"], cwd=tmp_path, env=env, check=False)
    assert (
        again.returncode != 0 and "MB free on the disk of" in again.stderr and "Traceback" not in again.stderr
    )
    assert len(list((small_disk / "runs" / "fit").iterdir())) == 1  # it made no run folder

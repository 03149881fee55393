"""SLURM preemption, rehearsed on one machine: the variables SLURM sets for a one-task batch job and a fake
``scontrol`` that records its call and then, as SLURM does when it requeues a job, sends the job SIGTERM.

``SIGUSR1`` (``#SBATCH --signal=USR1@90``) mid-fit saves ``last.ckpt``, requeues the job once and stops; the
requeued attempt (same command, same job id, ``SLURM_RESTART_COUNT=1``) resumes from it without ``ckpt_path``
and ends with the weights of an uninterrupted run. A signal during a checkpoint write never breaks the write.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf

from conftest import REPO, SMOKE, assert_same_last_weights, run_cli
from lit_amp_det.app.runs import slurm_resume_point, write_run_record
from lit_amp_det.app.tasks import start_checkpoint
from lit_amp_det.callbacks import last_checkpoint
from lit_amp_det.callbacks.last_checkpoint import LastCheckpoint
from lit_amp_det.slurm import SlurmJob, current_job, requeue_signal

COMMON = [*SMOKE, "trainer.deterministic=true"]
#: what SLURM sets for the one task of batch job 4242
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "maskrcnn",
    "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_NNODES": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "localhost",
}
FAKE_SCONTROL = """#!/bin/sh
# records its arguments, then ends the job as SLURM does when it requeues one: SIGTERM to the job's process
echo "$@" >> "$SCONTROL_LOG"
kill -TERM "$PPID"
"""


def _fake_slurm(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(FAKE_SCONTROL)
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IXUSR)
    tests = os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])
    return {
        **SLURM,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": tests,
        "SCONTROL_LOG": str(tmp_path / "scontrol.log"),
    }


@pytest.mark.slow
def test_a_preempted_job_requeues_and_its_next_attempt_resumes_exactly(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    run_cli(["fit", *COMMON], cwd=tmp_path, env={"LIT_AMP_DET_RUNS": str(straight)})

    runs = tmp_path / "runs"
    env = {**_fake_slurm(tmp_path), "LIT_AMP_DET_RUNS": str(runs)}
    # the same command for both attempts, as SLURM requeues it; the signal fires at step 3 only
    command = [
        "fit",
        *COMMON,
        "+callbacks.sig._target_=signaller.SignalAtStep",
        "+callbacks.sig.step=3",
        "+callbacks.sig.signum=SIGUSR1",
    ]
    preempted = run_cli(command, cwd=tmp_path, env=env, check=False)
    assert preempted.returncode == 128 + signal.SIGUSR1, preempted.stderr[-4000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # once, with the job id
    (first,) = (runs / "fit").iterdir()
    record = json.loads((first / "run.json").read_text())
    assert record["status"] == "requeued" and (record["slurm_job_id"], record["slurm_restart_count"]) == (
        "4242",
        0,
    )
    assert json.loads((first / "metrics.json").read_text())["interrupted_by"] == "SIGUSR1"
    assert (
        torch.load(first / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
        == 4
    )
    assert "SLURM job 4242 requeued" in preempted.stdout
    log = (first / "fit.log").read_text()
    assert "SIGTERM received while stopping: ignored" in log  # the fake scontrol's SIGTERM, during the stop

    requeued = run_cli(command, cwd=tmp_path, env={**env, "SLURM_RESTART_COUNT": "1"})
    (second,) = [p for p in (runs / "fit").iterdir() if p != first]
    record = json.loads((second / "run.json").read_text())
    assert record["status"] == "finished" and record["slurm_restart_count"] == 1
    assert record["resumed_from"] == str((first / "checkpoints" / "last.ckpt").resolve())
    assert "resuming its preempted attempt" in (second / "fit.log").read_text(), requeued.stdout[-2000:]
    assert json.loads((second / "metrics.json").read_text())["global_step"] == 8
    (straight_dir,) = (straight / "fit").iterdir()
    assert_same_last_weights(straight_dir, second)
    assert (
        tmp_path / "scontrol.log"
    ).read_text() == "requeue 4242\n"  # the finished attempt requeued nothing


def _srun(command: list[str], cwd: Path, env: dict[str, str], tasks: int) -> list[tuple[int, str]]:
    """``srun`` on one node: ``tasks`` processes of the command, each with its own ``SLURM_PROCID``; their
    exit codes and output. Each task writes to a file, as SLURM's ``--output`` does: a pipe read only after
    the first task ends fills up with the second task's output and blocks it inside a collective the first
    task is waiting in.
    """
    with socket.socket() as sock:  # a port of this test's own (SLURM would derive one from the job id)
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    shared = {
        **os.environ,
        **env,
        "SLURM_NTASKS": str(tasks),
        "SLURM_NTASKS_PER_NODE": str(tasks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    restart = env.get("SLURM_RESTART_COUNT", "0")
    logs = [cwd / f"srun-{restart}-task{task}.out" for task in range(tasks)]
    processes = []
    for task, log in enumerate(logs):
        with log.open("w") as output:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "lit_amp_det", *command],
                    cwd=cwd,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**shared, "SLURM_PROCID": str(task), "SLURM_LOCALID": str(task)},
                )
            )
    try:
        codes = [process.wait(timeout=300) for process in processes]
    except subprocess.TimeoutExpired:
        tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
        pytest.fail(f"srun of {tasks} tasks did not end in 300 s:\n{tails}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return [(code, log.read_text()) for code, log in zip(codes, logs)]


@pytest.mark.slow
def test_a_preempted_two_task_job_requeues_once_and_resumes_in_its_folder(tmp_path: Path) -> None:
    """``srun`` of two DDP tasks (the ranks SLURM starts, not Lightning) with the folder on the command line,
    as a user's sbatch script has it: SIGUSR1 reaches both tasks, rank 0 alone requeues, both stop after one
    save, and both tasks of the next attempt resume from it.
    """
    env = {**_fake_slurm(tmp_path), "SLURM_JOB_ID": "4243", "LIT_AMP_DET_RUNS": str(tmp_path / "runs")}
    folder = tmp_path / "shared" / "job-4243"
    command = [
        "fit",
        *SMOKE,
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "logger=none",
        f"hydra.run.dir={folder}",
        "+callbacks.sig._target_=signaller.SignalAtStep",
        "+callbacks.sig.step=1",
        "+callbacks.sig.signum=SIGUSR1",
    ]
    preempted = _srun(command, tmp_path, env, tasks=2)
    for code, output in preempted:
        assert code == 128 + signal.SIGUSR1, output[-4000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4243\n"  # rank 0 only, once
    record = json.loads((folder / "run.json").read_text())
    assert record["status"] == "requeued" and record["slurm_job_id"] == "4243"
    assert (
        torch.load(folder / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
        == 2
    )
    assert not (tmp_path / "runs").exists(), "no task may claim a folder of its own"

    resumed = _srun(command, tmp_path, {**env, "SLURM_RESTART_COUNT": "1"}, tasks=2)
    for code, output in resumed:
        assert code == 0, output[-4000:]
    record = json.loads((folder / "run.json").read_text())
    assert record["status"] == "finished" and record["slurm_restart_count"] == 1
    assert record["resumed_from"] == str((folder / "checkpoints" / "last.ckpt").resolve())
    assert (
        json.loads((folder / "metrics.json").read_text())["global_step"] == 4
    )  # 16 images / (4 x 2 tasks) x 2
    last = folder / "checkpoints" / "last.ckpt"
    resumes = f"SLURM job 4243, restart 1: resuming its preempted attempt from {last}"
    for log in ("fit.log", "fit_rank1.log"):  # each task found the attempt by itself
        assert resumes in (folder / log).read_text(), log
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4243\n"


def test_the_job_is_read_from_slurms_variables() -> None:
    assert current_job({}) is None
    assert (
        current_job({**SLURM, "SLURM_JOB_NAME": "interactive"}) is None
    )  # Lightning's rule: srun --pty bash
    assert current_job(SLURM) == SlurmJob("4242", 0)
    assert current_job({**SLURM, "SLURM_RESTART_COUNT": "2"}) == SlurmJob("4242", 2)
    array = {**SLURM, "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}
    assert current_job(array) == SlurmJob("77_3", 0)  # what `scontrol requeue` takes for an array task


def test_the_requeue_signal_is_usr1_by_hand_and_submitits_under_submitit() -> None:
    assert requeue_signal({}) == signal.SIGUSR1  # `#SBATCH --signal=USR1@90`
    assert (
        requeue_signal({"SUBMITIT_EXECUTOR": "slurm"}) == signal.SIGUSR2
    )  # submitit's `--signal=USR2@<delay>`
    assert requeue_signal({"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_PREEMPT_SIGNAL": "USR1"}) == signal.SIGUSR1


@pytest.mark.slow
def test_a_requeued_attempt_continues_in_the_folder_its_job_was_given(tmp_path: Path) -> None:
    """A job whose command fixes its folder (a sweep job's, as Hydra's submitit launcher reruns it on requeue)
    continues there: the one folder that an earlier run may be written into is its own job's earlier
    attempt's.
    """
    env = {**_fake_slurm(tmp_path), "LIT_AMP_DET_RUNS": str(tmp_path / "runs")}
    folder = tmp_path / "runs" / "multirun" / "sweep" / "0"
    command = [
        "fit",
        *SMOKE,
        f"hydra.run.dir={folder}",
        "+callbacks.sig._target_=signaller.SignalAtStep",
        "+callbacks.sig.step=1",
        "+callbacks.sig.signum=SIGUSR1",
    ]
    preempted = run_cli(command, cwd=tmp_path, env=env, check=False)
    assert preempted.returncode == 128 + signal.SIGUSR1, preempted.stderr[-4000:]
    assert json.loads((folder / "run.json").read_text())["status"] == "requeued"
    run_cli(command, cwd=tmp_path, env={**env, "SLURM_RESTART_COUNT": "1"})
    record = json.loads((folder / "run.json").read_text())
    assert record["status"] == "finished" and record["slurm_restart_count"] == 1
    assert record["resumed_from"] == str((folder / "checkpoints" / "last.ckpt").resolve())
    assert json.loads((folder / "metrics.json").read_text())["global_step"] == 8
    # another job, or a fresh submission of this one, never writes into it
    refused = run_cli(
        command, cwd=tmp_path, env={**env, "SLURM_JOB_ID": "5000", "SLURM_RESTART_COUNT": "1"}, check=False
    )
    assert refused.returncode != 0 and "already holds a run" in refused.stderr


def _attempt(runs: Path, name: str, job: str, restart: int, status: str, started: float, saved: bool) -> Path:
    run_dir = runs / "fit" / name
    (run_dir / "checkpoints").mkdir(parents=True)
    write_run_record(run_dir, "fit", slurm_job_id=job, slurm_restart_count=restart)
    record = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**record, "status": status, "started": started}))
    if saved:
        (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    return run_dir


def test_the_resume_point_is_the_newest_earlier_attempt_of_the_same_job(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    first = _attempt(runs, "a", "4242", 0, "requeued", 1.0, saved=True)
    assert slurm_resume_point(runs, "4242", 0) is None  # a first attempt never resumes anything
    assert slurm_resume_point(runs, "4242", 1) == first / "checkpoints" / "last.ckpt"
    # a SIGTERM without SIGUSR1 (preemption with a grace time, scancel): the next attempt continues it too
    second = _attempt(runs, "b", "4242", 1, "interrupted", 2.0, saved=True)
    assert slurm_resume_point(runs, "4242", 2) == second / "checkpoints" / "last.ckpt"
    _attempt(runs, "c", "4242", 2, "running", 3.0, saved=True)  # the attempt running now: never its own point
    assert slurm_resume_point(runs, "4242", 2) == second / "checkpoints" / "last.ckpt"
    _attempt(runs, "d", "999", 0, "requeued", 4.0, saved=True)  # another job
    _attempt(runs, "e", "4242", 2, "killed", 5.0, saved=False)  # killed before its first save: the one before
    assert slurm_resume_point(runs, "4242", 3) == runs / "fit" / "c" / "checkpoints" / "last.ckpt"
    _attempt(runs, "f", "4242", 3, "finished", 6.0, saved=True)
    assert slurm_resume_point(runs, "4242", 4) == runs / "fit" / "c" / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize("rank_zero_wrote_first", [False, True])
def test_every_task_of_a_requeued_attempt_resumes_from_the_same_file(
    tmp_path: Path, monkeypatch, rank_zero_wrote_first: bool
) -> None:
    """Under ``srun`` each task looks for the preempted attempt by itself, in the folder they share, while
    rank 0 replaces that folder's ``run.json`` with this attempt's record: before or after, task 1 finds rank
    0's file.
    """
    folder = _attempt(tmp_path / "runs", "job", "4243", 0, "requeued", 1.0, saved=True)
    checkpoint = folder / "checkpoints" / "last.ckpt"
    if rank_zero_wrote_first:
        write_run_record(
            folder, "fit", resumed_from=str(checkpoint), slurm_job_id="4243", slurm_restart_count=1
        )
    cfg = OmegaConf.create(
        {
            "command": "fit",
            "ckpt_path": None,
            "paths": {"output_dir": str(folder), "runs_root": str(tmp_path / "elsewhere")},
        }
    )
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert start_checkpoint(cfg, folder, SlurmJob("4243", 1)) == str(checkpoint)


def test_a_task_started_by_srun_resolves_a_run_folder_as_rank_zero_does(tmp_path: Path, monkeypatch) -> None:
    earlier = _attempt(tmp_path / "runs", "earlier", "1", 0, "interrupted", 1.0, saved=True)
    cfg = OmegaConf.create(
        {
            "command": "fit",
            "ckpt_path": str(earlier),
            "paths": {"output_dir": str(tmp_path / "now"), "runs_root": str(tmp_path / "runs")},
        }
    )
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert start_checkpoint(cfg, tmp_path / "now", None) == str(
        (earlier / "checkpoints" / "last.ckpt").resolve()
    )


class _SignallingTrainer:
    """What ``LastCheckpoint.save`` uses of a Trainer; the write sends this process ``signum`` halfway
    through.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.global_step = 7
        self.world_size = 1
        self.is_global_zero = True
        self.strategy = SimpleNamespace(barrier=lambda name: None)

    def save_checkpoint(self, path: Path, weights_only: bool = False) -> None:
        with open(path, "wb") as sink:
            sink.write(b"first half;")
            os.kill(os.getpid(), self.signum)  # Python runs the handler here, between the two writes
            sink.write(b"second half")


@pytest.mark.parametrize("under_slurm", [False, True])
def test_a_signal_during_a_checkpoint_write_waits_for_the_write(
    tmp_path: Path, monkeypatch, under_slurm
) -> None:
    for name in SLURM:
        monkeypatch.delenv(name, raising=False)
    if under_slurm:
        for name, value in SLURM.items():
            monkeypatch.setenv(name, value)
    callback = LastCheckpoint(tmp_path)
    callback.path.write_bytes(b"previous")
    callback._install_handlers()
    try:
        os.kill(
            os.getpid(), signal.SIGUSR1 if under_slurm else signal.SIGINT
        )  # the first signal: stop after the step
        trainer = _SignallingTrainer(signal.SIGTERM)  # the second arrives inside the write
        if under_slurm:  # SLURM's SIGTERM while the run stops: ignored, the save completes and returns
            assert callback.save(trainer) == str(callback.path)
        else:  # a second signal exits at once (128 + its number), but only once the file is complete
            monkeypatch.setattr(last_checkpoint, "_exit_now", lambda signum, kept: sys.exit(128 + signum))
            with pytest.raises(SystemExit) as stopped:
                callback.save(trainer)
            assert stopped.value.code == 143
        assert callback.path.read_bytes() == b"first half;second half"
    finally:
        callback._restore_handlers()

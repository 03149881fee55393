"""What a SLURM job adds to a run: its identity, the requeue call, and the preempted attempt to continue.

A job submitted with ``#SBATCH --signal=USR1@90`` (and ``--requeue``) gets ``SIGUSR1`` 90 seconds before its
time limit or preemption (``SIGUSR2`` if submitit started it: :func:`requeue_signal`).
:class:`~lit_amp_det.callbacks.last_checkpoint.LastCheckpoint` answers it: the step in progress completes,
``checkpoints/last.ckpt`` is written, rank 0 runs ``scontrol requeue`` (:func:`requeue`) and the run stops
with status ``requeued``. SLURM then ends the job (``SIGTERM``, which the stopping run ignores) and starts the
same command again with the same job id and ``SLURM_RESTART_COUNT`` raised; ``fit`` finds the earlier attempt
from the job id and restart count its ``run.json`` records (:func:`lit_amp_det.app.runs.slurm_resume_point`)
and resumes from its checkpoint without ``ckpt_path``. Lightning's own requeue handler (which saves inside the
signal handler) is turned off: :func:`cluster_plugins`.

Detection follows Lightning's :class:`~lightning.fabric.plugins.environments.SLURMEnvironment`:
``SLURM_NTASKS`` is set and the job is not interactive (job name ``bash`` or ``interactive``).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from typing import Any

__all__ = ["REQUEUE_SIGNAL", "SlurmJob", "cluster_plugins", "current_job", "requeue", "requeue_signal"]

log = logging.getLogger(__name__)

#: the signal ``#SBATCH --signal=USR1@90`` sends before the time limit: save, requeue, stop
REQUEUE_SIGNAL = "SIGUSR1"
#: submitit (``hydra/launcher=slurm``) submits ``--signal=USR2@<delay>``, or the signal this variable names
SUBMITIT_SIGNAL_VARIABLE = "SUBMITIT_PREEMPT_SIGNAL"


@dataclass(frozen=True)
class SlurmJob:
    """The SLURM job this process runs in: ``job_id`` is ``<array job>_<task>`` for an array task (what
    ``scontrol requeue`` takes), else ``SLURM_JOB_ID``; ``restart_count`` is ``SLURM_RESTART_COUNT`` (0 on the
    first attempt).
    """

    job_id: str
    restart_count: int

    def record(self) -> dict[str, Any]:
        """The fields ``run.json`` keeps, so that a later attempt of the job finds this one."""
        return {"slurm_job_id": self.job_id, "slurm_restart_count": self.restart_count}


def current_job(environ: os._Environ[str] | dict[str, str] | None = None) -> SlurmJob | None:
    """The batch job this process belongs to; ``None`` outside SLURM and in interactive jobs."""
    env = os.environ if environ is None else environ
    if "SLURM_NTASKS" not in env or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array_job}_{array_task}" if array_job and array_task else env.get("SLURM_JOB_ID")
    if not job_id or not re.fullmatch(r"[0-9_]+", job_id):
        return None
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    return SlurmJob(job_id, int(restarts) if restarts.isdigit() else 0)


def requeue_signal(environ: os._Environ[str] | dict[str, str] | None = None) -> signal.Signals:
    """The signal that announces the end of the job: ``SIGUSR1`` in a job submitted by hand, submitit's
    (``SIGUSR2`` unless ``SUBMITIT_PREEMPT_SIGNAL`` names another) in a job submitit started.
    """
    env = os.environ if environ is None else environ
    if "SUBMITIT_EXECUTOR" in env:
        name = "SIG" + env.get(SUBMITIT_SIGNAL_VARIABLE, "USR2").removeprefix("SIG")
        if name in signal.Signals.__members__:
            return signal.Signals[name]
    return signal.Signals[REQUEUE_SIGNAL]


def cluster_plugins() -> list[Any]:
    """Lightning's SLURM environment without its auto-requeue (``LastCheckpoint`` requeues after a clean
    save); empty outside SLURM, where Lightning picks the environment itself.
    """
    if current_job() is None:
        return []
    from lightning.fabric.plugins.environments import SLURMEnvironment  # deferred: imports torch

    return [SLURMEnvironment(auto_requeue=False)]


def requeue(job: SlurmJob) -> bool:
    """Runs ``scontrol requeue <job id>``; whether it succeeded (a failure is logged, not raised: the
    checkpoint is saved either way and the job can be resubmitted by hand).
    """
    command = ["scontrol", "requeue", job.job_id]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        log.warning(
            "`%s` failed (%s): the job was not requeued; resubmit it to resume", " ".join(command), err
        )
        return False
    if result.returncode != 0:
        log.warning(
            "`%s` exited with %d (%s): the job was not requeued; resubmit it to resume",
            " ".join(command),
            result.returncode,
            (result.stderr or result.stdout).strip()[-500:],
        )
        return False
    log.warning(
        "requeued SLURM job %s: it continues from the checkpoint when SLURM starts it again", job.job_id
    )
    return True

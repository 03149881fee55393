"""Multi-process runs under Hydra: what Lightning's DDP launcher needs to start the other processes right.

With ``strategy=ddp`` on one node, Lightning starts ranks 1..N-1 by re-running the command line with
``hydra.run.dir=<parent run dir>``. For a Hydra app with a subcommand, ``sys.argv`` is then Hydra's (no
subcommand; a sweep's ``-m`` and comma lists still there), so the children would re-launch the whole sweep or
fail; and in a multirun job ``hydra.run.dir`` is the *single-run* pattern, so they would write outside their
job's directory.

:func:`ddp_child_command` fixes both for the duration of a task, and at the job's end destroys its process
group and undoes the environment variables Lightning set (``LOCAL_RANK``, ``MASTER_PORT``, ...), so the next
job of a sweep starts its own ranks instead of waiting for the last job's. On SLURM
(``hydra/launcher=submitit_slurm``) the scheduler starts every rank and none of this is used.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

__all__ = ["adopt_launch_rank", "ddp_child_command", "launch_rank", "rank_suffix"]


def rank_suffix() -> str:
    """``""`` in the first process of a run, ``"_rank<K>"`` in the others (for per-rank log files). Reads the
    environment Lightning's launcher (``LOCAL_RANK``, ``NODE_RANK``) or SLURM (``SLURM_PROCID``) sets before
    the process starts, so it works while Hydra composes the config, before Lightning runs.
    """
    if "SLURM_PROCID" in os.environ and "LOCAL_RANK" not in os.environ:
        rank = int(os.environ["SLURM_PROCID"])
        return "" if rank == 0 else f"_rank{rank}"
    local = int(os.environ.get("LOCAL_RANK", 0))
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", 0)))
    if node:  # no world size here to make a global rank: name other nodes' processes by node and local rank
        return f"_node{node}_rank{local}"
    return "" if local == 0 else f"_rank{local}"


def launch_rank(devices_per_node: int = 1) -> int:
    """This process's global rank from its launcher's environment, before any process group exists: ``RANK``
    (torchrun), else ``SLURM_PROCID`` (srun), else ``NODE_RANK x devices_per_node + LOCAL_RANK`` (Lightning's
    launcher on each node of a multi-node run).
    """
    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    node = int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")) or 0)
    return node * devices_per_node + int(os.environ.get("LOCAL_RANK", "0") or 0)


def adopt_launch_rank(devices_per_node: int) -> None:
    """Tells Lightning's ``rank_zero_only`` this process's rank before the Trainer sets up its process group.
    Lightning reads ``RANK``, ``LOCAL_RANK`` and ``SLURM_PROCID`` on import; the first process of node ``k >
    0`` has only ``NODE_RANK``, so until the Trainer connects it would take itself for rank 0 and claim node
    0's folder.
    """
    from lightning.pytorch.utilities import rank_zero_only

    if rank := launch_rank(devices_per_node):
        rank_zero_only.rank = rank


@contextmanager
def ddp_child_command(cfg: DictConfig) -> Iterator[None]:
    """Within the block, Lightning's DDP launcher starts the other ranks as this job, in this job's directory.
    A no-op outside a Hydra app (notebooks, tests); ``sys.argv``, the environment and the Hydra run directory
    are restored on exit, so a sweep's next job starts from the original state.
    """
    import torch.distributed as dist
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        yield
        return
    hydra_cfg = HydraConfig.get()
    saved_argv, saved_environ = list(sys.argv), dict(os.environ)
    # hydra.run.dir unresolved: resolving it runs the unique_dir resolver, which would create a folder in a
    # sweep's job
    saved_run_dir = OmegaConf.to_container(hydra_cfg.run)["dir"]
    sys.argv = [saved_argv[0], str(cfg.command), *hydra_cfg.overrides.task, "hydra.mode=RUN"]
    with read_write(hydra_cfg), open_dict(hydra_cfg):
        hydra_cfg.run.dir = str(cfg.paths.output_dir)  # Lightning sends the children to hydra.run.dir
    try:
        yield
    finally:
        if (
            dist.is_available() and dist.is_initialized()
        ):  # the next job of a sweep starts its own process group
            dist.destroy_process_group()
        sys.argv = saved_argv
        # Lightning leaves LOCAL_RANK, MASTER_PORT, ... in the environment; with them the next job of a sweep
        # would take its ranks as started by someone else and wait for them forever
        os.environ.clear()
        os.environ.update(saved_environ)
        with read_write(hydra_cfg), open_dict(hydra_cfg):
            hydra_cfg.run.dir = saved_run_dir

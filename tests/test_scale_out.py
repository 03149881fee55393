"""Scale-out plumbing without processes: SLURM launcher configs, per-rank logs, argv handling, eval shards."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import get_class
from omegaconf import OmegaConf

from conftest import compose_config
from lit_amp_det.app.config import config_dir
from lit_amp_det.app.launch import ddp_child_command, rank_suffix
from lit_amp_det.cli import hydra_argv
from lit_amp_det.data.sampler import EvalShardSampler


def _hydra_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=overrides, return_hydra_config=True)


def test_slurm_launcher_sizes_the_allocation_from_the_trainer() -> None:
    cfg = _hydra_config(
        [
            "hydra/launcher=slurm",
            "trainer=ddp",
            "trainer.num_nodes=2",
            "trainer.devices=8",
            "hydra.launcher.partition=gpu",
        ]
    )
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert get_class(launcher._target_).__name__ == "SlurmLauncher"  # the plugin is installed
    launcher_node = OmegaConf.select(cfg, "hydra.launcher")
    resolved = {
        key: launcher_node[key]
        for key in ("nodes", "tasks_per_node", "gpus_per_node", "partition", "timeout_min")
    }
    assert (resolved["nodes"], resolved["tasks_per_node"], resolved["gpus_per_node"]) == (2, 8, 8)
    assert resolved["partition"] == "gpu" and resolved["timeout_min"] == 1440
    # CPUs per task follow the loader workers each rank starts, as asked on this host (not clamped to its
    # CPUs)
    for data, cpus in ((["data=coco"], 5), (["data=coco", "data.num_workers=11"], 12), (["data=shapes"], 1)):
        sized = _hydra_config(["hydra/launcher=slurm", "trainer=ddp", *data])
        assert OmegaConf.select(sized, "hydra.launcher")["cpus_per_task"] == cpus, data


def test_the_sbatch_script_submitit_would_submit_for_2_nodes_of_8_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's parameters go to submitit as the plugin passes them (``BaseSubmititLauncher.launch``:
    the queue-independent keys as they are, the rest prefixed ``slurm_``); submitit writes the script, nothing
    is submitted (a stand-in ``srun`` on PATH is all it looks for).
    """
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text("#!/bin/sh\nexit 1\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{srun.parent}:{os.environ['PATH']}")
    cfg = _hydra_config(
        [
            "hydra/launcher=slurm",
            "trainer=ddp",
            "trainer.num_nodes=2",
            "trainer.devices=8",
            "data=coco",
            "data.num_workers=7",
            "hydra.launcher.partition=gpu",
            f"hydra.sweep.dir={tmp_path}",
        ]
    )
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    params = {k: v for k, v in params.items() if k not in ("_target_", "submitit_folder", "max_num_timeout")}
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor = submitit.AutoExecutor(cluster="slurm", folder=tmp_path / ".submitit")
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    script = executor._executor._make_submission_file_text("python -u -m submitit.core._submit", "uid")
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=8",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=1440",
    ):
        assert line in script, f"{line!r} not in the sbatch script:\n{script}"
    assert "srun" in script  # one task per GPU, each a DDP rank that Lightning's SLURMEnvironment reads


def test_the_plugins_own_submitit_slurm_config_composes_too() -> None:
    cfg = _hydra_config(
        [
            "hydra/launcher=submitit_slurm",
            "trainer=ddp",
            "hydra.launcher.nodes=2",
            "hydra.launcher.tasks_per_node=4",
        ]
    )
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.nodes == 2 and cfg.hydra.launcher.tasks_per_node == 4


@pytest.mark.parametrize(
    ("environ", "suffix"),
    [
        ({}, ""),
        ({"LOCAL_RANK": "0"}, ""),
        ({"LOCAL_RANK": "1"}, "_rank1"),
        ({"LOCAL_RANK": "3", "NODE_RANK": "1"}, "_node1_rank3"),
        ({"SLURM_PROCID": "0"}, ""),
        ({"SLURM_PROCID": "9"}, "_rank9"),
    ],
)
def test_rank_suffix_names_each_process_log(
    environ: dict[str, str], suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    assert rank_suffix() == suffix


def test_log_file_name_uses_the_rank_suffix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = _hydra_config(["hydra.runtime.output_dir=/tmp/x"])
    assert cfg.hydra.job_logging.handlers.file.filename == "/tmp/x/fit_rank1.log"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["seed=1", "--cfg", "job", "trainer.max_epochs=3"],
            ["--cfg", "job", "seed=1", "trainer.max_epochs=3"],
        ),
        (["-m", "a=1,2", "--info", "defaults"], ["-m", "--info", "defaults", "a=1,2"]),
        (["--info", "x=1"], ["--info", "x=1"]),
        (["--cfg=job", "x=1"], ["--cfg=job", "x=1"]),
    ],
)
def test_hydra_argv_puts_flags_before_overrides(args: list[str], expected: list[str]) -> None:
    assert hydra_argv(args, "fit") == [*expected, "command=fit"]


def test_ddp_child_command_is_a_no_op_outside_a_hydra_app() -> None:
    argv = list(sys.argv)
    with ddp_child_command(compose_config(["experiment=smoke"], output_dir=Path("/tmp/unused"))):
        assert sys.argv == argv
    assert sys.argv == argv


@pytest.mark.parametrize("size", [0, 1, 7, 8])
def test_eval_shards_cover_every_image_once(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import lit_amp_det.data.sampler as sampler

    shards = []
    for rank in range(3):
        monkeypatch.setattr(sampler, "_distributed_rank_and_size", lambda rank=rank: (rank, 3))
        shard = list(EvalShardSampler(size))
        assert len(shard) == len(EvalShardSampler(size))
        shards.append(shard)
    assert sorted(i for shard in shards for i in shard) == list(range(size))
    monkeypatch.setattr(sampler, "_distributed_rank_and_size", lambda: (0, 1))
    assert list(EvalShardSampler(size)) == list(range(size))


def test_the_readmes_batch_script_asks_slurm_for_what_its_command_runs() -> None:
    """The README's ``sbatch`` script: its ``srun`` command composes, and its allocation is the one
    ``hydra/launcher=slurm`` derives from that command's config (nodes, tasks and GPUs per node, CPUs per
    task).
    """
    import re
    import shlex

    from conftest import REPO

    text = (REPO / "README.md").read_text()
    script = re.search(r"\n```bash\n(#SBATCH [^\n]*)\n(srun .*?)\n```", text, re.S)
    assert script is not None, "the Scaling out section has a batch script"
    sbatch = dict(re.findall(r"--([a-z-]+)=(\S+)", script.group(1)))
    words = shlex.split(script.group(2).replace("\\\n", " ").replace("$SLURM_JOB_ID", "4242"))
    assert words[:5] == ["srun", "python", "-m", "lit_amp_det", "fit"]
    assert "--requeue" in script.group(1) and sbatch["signal"] == "USR1@90"  # what LastCheckpoint answers
    cfg = _hydra_config([*words[5:], "hydra/launcher=slurm"])
    launcher = OmegaConf.select(cfg, "hydra.launcher")
    assert cfg.trainer.strategy._target_.endswith("DDPStrategy") and cfg.data.root == "/data/coco"
    assert {
        key: int(sbatch[key]) for key in ("nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task")
    } == {
        "nodes": launcher["nodes"],
        "ntasks-per-node": launcher["tasks_per_node"],
        "gpus-per-node": launcher["gpus_per_node"],
        "cpus-per-task": launcher["cpus_per_task"],
    }
    assert (
        cfg.hydra.run.dir == "/shared/runs/4242"
    )  # every task of the job, and its requeued attempts, in one folder

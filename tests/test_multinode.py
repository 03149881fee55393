"""Two nodes x two processes on one machine (gloo over loopback), the topology of a multi-node run: one world,
one run folder written by global rank 0, evaluation over every image once, and a resume on another node count.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from lit_amp_det.data.sampler import ResumableBatchSampler

pytestmark = pytest.mark.slow

TRAIN, VAL, BATCH = 16, 7, 2
COMMON = [
    "fit",
    "experiment=smoke",
    "trainer=ddp",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "logger=none",
    f"data.train_size={TRAIN}",
    f"data.val_size={VAL}",
    f"data.batch_size={BATCH}",
    "+callbacks.ddp_probe._target_=ddp_probe.DDPProbe",
    "+callbacks.ddp_probe.dirpath=${paths.output_dir}",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _probes(run_dir: Path, world: int) -> list[dict]:
    return [json.loads((run_dir / f"ddp_probe_rank{rank}.json").read_text()) for rank in range(world)]


def _expected_ids(monkeypatch: pytest.MonkeyPatch, epoch: int, rank: int, world: int) -> list[list[int]]:
    """The image ids of each batch rank ``rank`` of ``world`` trains on in ``epoch`` (seed 0, shapes: id =
    index + 1).
    """
    monkeypatch.setattr("lit_amp_det.data.sampler._distributed_rank_and_size", lambda: (rank, world))
    sampler = ResumableBatchSampler(TRAIN, BATCH, seed=0, group_ids=[1] * TRAIN)
    sampler.set_epoch(epoch)
    return [[index + 1 for index, _ in batch] for batch in sampler]


def test_two_nodes_of_two_processes_then_resume_on_one_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = (
        tmp_path / "shared" / "run"
    )  # a multi-node run names its folder: every node must find the same one
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "PYTHONUNBUFFERED": "1",
        "HYDRA_FULL_ERROR": "1",
        "OMP_NUM_THREADS": "1",
    }
    args = [
        sys.executable,
        "-m",
        "lit_amp_det",
        *COMMON,
        "trainer.num_nodes=2",
        "trainer.max_epochs=1",
        "trainer.check_val_every_n_epoch=1",
        f"hydra.run.dir={run_dir}",
    ]
    nodes = [
        subprocess.Popen(
            args,
            cwd=tmp_path,
            env={**env, "NODE_RANK": str(node)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-6000:]

    probes = _probes(run_dir, 4)
    assert [p["global_rank"] for p in probes] == [0, 1, 2, 3] and {p["world_size"] for p in probes} == {4}
    assert len({round(p["weights_checksum"], 9) for p in probes}) == 1, (
        "all four ranks must end with one model"
    )
    for rank, probe in enumerate(probes):  # each rank trains on every 4th image of the epoch's order
        assert probe["train_ids"] == [[0, ids] for ids in _expected_ids(monkeypatch, 0, rank, 4)]
    assert sorted(p["val_images"] for p in probes) == [1, 2, 2, 2]
    assert all(p["images_scored"] == [VAL] for p in probes), (
        "COCO evaluation must see every image exactly once"
    )

    # global rank 0 (node 0's first process) alone owns the folder; the other node wrote only its logs into it
    record = json.loads((run_dir / "run.json").read_text())
    assert record["pid"] == nodes[0].pid and record["status"] == "finished"
    assert not (tmp_path / "runs").exists(), "no process may have claimed a folder of its own"
    assert json.loads((run_dir / "metrics.json").read_text())["perf"]["world_size"] == 4
    assert {p.name for p in run_dir.glob("fit*.log")} == {
        "fit.log",
        "fit_rank1.log",
        "fit_node1_rank0.log",
        "fit_node1_rank1.log",
    }
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()

    # the next epoch on one node of two processes: the checkpoint is from the end of an epoch, so it resumes
    run_cli(
        [*COMMON, "trainer.num_nodes=1", "trainer.max_epochs=2", f"ckpt_path={run_dir}"],
        cwd=tmp_path,
        env={"PYTHONPATH": env["PYTHONPATH"]},
    )
    (resumed,) = (tmp_path / "runs" / "fit").iterdir()
    probes = _probes(resumed, 2)
    for rank, probe in enumerate(probes):
        assert probe["world_size"] == 2
        assert probe["train_ids"] == [[1, ids] for ids in _expected_ids(monkeypatch, 1, rank, 2)]
        assert probe["global_step"] == TRAIN // 4 // BATCH + TRAIN // 2 // BATCH
    assert json.loads((resumed / "run.json").read_text())["resumed_from"] == str(
        run_dir / "checkpoints" / "last.ckpt"
    )

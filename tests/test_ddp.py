"""DDP with 2 CPU processes (gloo) on the tiny config: ranks, shards, precision, regions, callbacks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import REPO, compose_config, run_cli

pytestmark = pytest.mark.slow


def _probe(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / f"ddp_probe_rank{rank}.json").read_text())


def test_a_ddp_fit_stopped_by_ctrl_c_resumes_with_last_on_every_rank_under_the_plugin(tmp_path: Path) -> None:
    """Ctrl-C on a two-process fit saves one checkpoint; ``ckpt_path=last`` resumes it on both ranks (the
    second is started with the file rank 0 resolved, not with ``last`` again), here in bf16-mixed with
    ``callbacks=fast``: what every rank then runs (strategy, precision regions, speedups, frozen norms,
    shards) is probed.
    """
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    ddp = [
        "experiment=smoke",
        "trainer=ddp",
        "trainer.accelerator=cpu",
        "trainer.devices=2",
        "logger=none",
        "data.train_size=16",
        "data.val_size=7",
        "trainer.max_epochs=2",
    ]
    stopped = run_cli(
        ["fit", *ddp, "+callbacks.sig._target_=signaller.SignalAtStep", "+callbacks.sig.step=1"],
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    (first,) = (tmp_path / "runs" / "fit").iterdir()
    assert (
        torch.load(first / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["global_step"]
        == 2
    )
    resumed = run_cli(
        [
            "fit",
            *ddp,
            "ckpt_path=last",
            "trainer.precision=bf16-mixed",
            "callbacks=fast",
            "callbacks.memory_monitor.warmup_steps=0",
            "callbacks.memory_monitor.baseline_steps=1",
            "+callbacks.ddp_probe._target_=ddp_probe.DDPProbe",
            "+callbacks.ddp_probe.dirpath=${paths.output_dir}",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert f"resuming {first.resolve() / 'checkpoints' / 'last.ckpt'} (step 2" in resumed.stdout
    runs = sorted((tmp_path / "runs" / "fit").iterdir())
    assert len(runs) == 2, f"the second rank must write into the first one's run directory, found {runs}"
    (run_dir,) = [p for p in runs if p != first]
    ranks = [_probe(run_dir, 0), _probe(run_dir, 1)]
    for rank, probe in enumerate(ranks):
        assert probe["global_rank"] == rank and probe["world_size"] == 2
        assert probe["strategy"] == "DDPStrategy" and probe["wrapped_model"] == "DistributedDataParallel"
        assert probe["backend"] == "gloo"
        # the precision plugin under DDP: autocast reaches the backbone, the fp32 regions stay fp32
        assert probe["precision_plugin"] == "DetectionMixedPrecision" and probe["precision"] == "bf16-mixed"
        assert probe["backbone_dtype"] == "torch.bfloat16"
        assert probe["box_predictor_dtype"] == "torch.float32"
        assert probe["fp32_region_installed"]
        # every rank runs the model its configure_model made, with the fp32 regions installed on it
        assert probe["applied_speedups"] == ["ext_ops", "binary_mask_paste"]
        assert (probe["rpn_class"], probe["transform_class"]) == (
            "ExtRegionProposalNetwork",
            "BinaryMaskTransform",
        )
        assert probe["transform_region_installed"]
        # callbacks=fast under DDP: frozen norms with the conv-bn eval fold on every rank
        assert probe["conv_bn_eval"] and probe["norms_in_train_mode"] == 0
        # each rank trains on its half of the second epoch's data and scores its shard of the 7 validation
        # images
        assert probe["train_images"] == 8
    assert sorted(p["val_images"] for p in ranks) == [3, 4]
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 4  # 16 images / (4 x 2 ranks) x 2 epochs
    assert ranks[0]["weights_checksum"] == pytest.approx(ranks[1]["weights_checksum"], rel=1e-12), (
        "gradients are all-reduced: both ranks must end with the same weights"
    )
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["perf"]["world_size"] == 2 and metrics["global_step"] == 4
    assert "val/segm_mAP" in metrics["metrics"]
    assert (run_dir / "fit.log").is_file() and (run_dir / "fit_rank1.log").is_file()


def test_sync_batchnorm_on_cpu_is_refused_with_the_reason(tmp_path: Path) -> None:
    proc = run_cli(
        ["fit", "experiment=smoke", "trainer=ddp", "trainer.accelerator=cpu", "trainer.sync_batchnorm=true"],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode != 0
    assert "trainer.sync_batchnorm=true needs GPUs" in proc.stderr


def test_ddp_trainer_config_composes() -> None:
    cfg = compose_config(["trainer=ddp"], output_dir=Path("/tmp/unused"))
    assert cfg.trainer.strategy._target_ == "lightning.pytorch.strategies.DDPStrategy"
    assert cfg.trainer.devices == 2 and cfg.trainer.num_nodes == 1 and cfg.trainer.sync_batchnorm is False
    assert cfg.trainer.use_distributed_sampler is False  # the data modules shard themselves


def test_ddp_jobs_of_a_sweep_each_start_their_own_ranks(tmp_path: Path) -> None:
    """Two DDP jobs in one multirun: the second must not wait for the first one's ranks or reuse its group."""
    run_cli(
        [
            "fit",
            "-m",
            "experiment=smoke",
            "trainer=ddp",
            "trainer.accelerator=cpu",
            "logger=none",
            "callbacks=none",
            "seed=1,2",
            "trainer.max_epochs=1",
            "trainer.check_val_every_n_epoch=1",
        ],
        cwd=tmp_path,
    )
    (sweep,) = (tmp_path / "runs" / "multirun").iterdir()
    for job in ("0", "1"):
        metrics = json.loads((sweep / job / "metrics.json").read_text())
        assert metrics["perf"]["world_size"] == 2 and metrics["global_step"] == 2
        assert (sweep / job / "fit_rank1.log").is_file(), "rank 1 must log into its own job's directory"
    assert "job #1 seed=2" in (sweep / "summary.md").read_text()

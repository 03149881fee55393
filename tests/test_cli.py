"""The command line end to end: fit -> validate/test/predict, multirun, research subclass, bad input."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from pycocotools.coco import COCO

from conftest import REPO, SMOKE, compose_config, only_run_dir, run_cli
from lit_amp_det.data import ShapesDataModule


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> tuple[Path, str]:
    """One smoke fit shared by the tests below: (run directory, its stdout)."""
    work = tmp_path_factory.mktemp("trained")
    env = {"LIT_AMP_DET_CACHE": str(cache_dir), "LIT_AMP_DET_RUNS": str(work / "runs")}
    proc = run_cli(["fit", *SMOKE], cwd=work, env=env)
    return only_run_dir(work / "runs"), proc.stdout


@pytest.mark.slow
def test_fit_writes_config_checkpoints_logs_and_metrics(trained: tuple[Path, str]) -> None:
    run_dir, stdout = trained
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["command"] == "fit" and metrics["global_step"] == 8
    for key in ("val/bbox_mAP", "val/bbox_mAP_50", "val/segm_mAP", "val/segm_mAP_50"):
        assert 0.0 <= metrics["metrics"][key] <= 1.0
    assert f"val segm mAP {metrics['metrics']['val/segm_mAP']:.3f}" in stdout
    perf = metrics["perf"]  # RunStats: 8 steps, the first 2 untimed
    assert perf["device"] == "cpu" and perf["world_size"] == 1 and perf["timed_steps"] == 6
    assert perf["train_images_per_s"] > 0 and perf["train_step_ms_median"] > 0 and perf["peak_memory_mb"] > 0
    assert 0 <= perf["step_memory_mb"] <= perf["peak_memory_mb"]
    resolved = OmegaConf.load(run_dir / "config_resolved.yaml")
    assert resolved.command == "fit" and resolved.model.num_classes is None
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    (best,) = (run_dir / "checkpoints").glob(
        "best-*.ckpt"
    )  # weights only: no optimizer state, a third the size
    assert "optimizer_states" not in torch.load(best, map_location="cpu", weights_only=True)
    assert best.stat().st_size < 0.5 * (run_dir / "checkpoints" / "last.ckpt").stat().st_size
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    header = (run_dir / "logs" / "metrics.csv").read_text().splitlines()[0].split(",")
    for column in ("train/loss", "train/lr", "train/loss_mask", "train/loss_objectness", "val/segm_mAP"):
        assert column in header
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["hyper_parameters"]["num_classes"] == 7
    assert checkpoint["hyper_parameters"]["class_names"][0] == "circle"
    assert checkpoint["hyper_parameters"][
        "speedups"
    ] == {  # plain data, as conf/speedups/default.yaml names them
        "ext_ops": {"_target_": "lit_amp_det.models.speedups.ExtensionOps"},
        "binary_mask_paste": {"_target_": "lit_amp_det.models.speedups.BinaryMaskPaste"},
        "sync_free": {
            "_target_": "lit_amp_det.models.speedups.SyncFree",
            "devices": ["cuda"],
            "instances_per_image": None,
        },
        "channels_last": None,
        "compile": None,
    }
    assert "speedups on cpu: ext_ops, binary_mask_paste" in (run_dir / "fit.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("source", ["ckpt_path", "model.weights", "ckpt_path speedups=none"])
def test_validate_reproduces_the_final_fit_metrics(
    trained: tuple[Path, str], tmp_path: Path, source: str
) -> None:
    """From the checkpoint as ``ckpt_path`` or as ``model.weights``, and on torchvision's model (the speedups
    change how the model computes, not its detections).
    """
    run_dir, _ = trained
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    key, *more = source.split()
    run_cli(["validate", *SMOKE, f"{key}={ckpt}", *more], cwd=tmp_path)
    validated = json.loads((only_run_dir(tmp_path / "runs") / "metrics.json").read_text())["metrics"]
    fitted = json.loads((run_dir / "metrics.json").read_text())["metrics"]
    for key in ("val/bbox_mAP", "val/segm_mAP", "val/segm_mAP_50"):
        assert validated[key] == pytest.approx(fitted[key], abs=1e-6)


@pytest.mark.slow
def test_test_and_predict_from_checkpoint(trained: tuple[Path, str], tmp_path: Path, cache_dir: Path) -> None:
    run_dir, _ = trained
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    proc = run_cli(["test", *SMOKE, f"ckpt_path={ckpt}"], cwd=tmp_path)
    tested = json.loads(next((tmp_path / "runs" / "test").glob("*/metrics.json")).read_text())
    assert tested["command"] == "test" and "test/segm_mAP" in tested["metrics"]
    assert tested["best_model_path"] is None  # the fit's checkpoint callbacks are not this run's
    assert "dirpath has changed" not in proc.stderr

    proc = run_cli(
        ["predict", *SMOKE, f"ckpt_path={ckpt}", "callbacks.prediction_writer.score_threshold=0.0"],
        cwd=tmp_path,
    )
    assert "dirpath has changed" not in proc.stderr
    predictions = next((tmp_path / "runs" / "predict").glob("*/predictions.json"))
    records = json.loads(predictions.read_text())
    assert records and {"image_id", "category_id", "bbox", "score", "segmentation"} <= records[0].keys()
    smoke = compose_config(
        SMOKE
    ).data  # the smoke data's own folder: other tests generate other sets in the cache
    shapes = ShapesDataModule(
        cache_dir,
        train_size=smoke.train_size,
        val_size=smoke.val_size,
        test_size=smoke.test_size,
        image_size=smoke.image_size,
    )
    annotations = shapes.root / "annotations" / "instances_val.json"
    ground_truth = COCO(str(annotations))
    results = ground_truth.loadRes(str(predictions))  # the official loader accepts the file
    assert set(results.getImgIds()) <= set(ground_truth.getImgIds())
    assert {r["category_id"] for r in records} <= set(ground_truth.getCatIds())


@pytest.mark.slow
def test_predict_on_a_folder_of_pictures(trained: tuple[Path, str], tmp_path: Path) -> None:
    """``data.predict_images``: detections of unannotated pictures, with the images index that makes
    ``predictions.json`` readable by pycocotools' ``loadRes`` (ids, file names, sizes, categories), and
    pictures named after the files. With ``data=coco`` and no ``data.root``: the training data is not on this
    machine, the classes come from the checkpoint.
    """
    from test_predict_folder import pictures_folder

    run_dir, _ = trained
    sizes = pictures_folder(tmp_path / "pictures")
    smoke_model = [
        "model=maskrcnn_tiny",
        "model.rpn.anchor_sizes=[8,16,32,64,128]",
        "model.transform.min_size=64",
        "model.transform.max_size=64",
        "trainer.enable_progress_bar=false",
    ]  # experiment=smoke's model
    run_cli(
        [
            "predict",
            "data=coco",
            *smoke_model,
            f"ckpt_path={run_dir}",
            "data.predict_images=pictures",
            "callbacks.prediction_writer.score_threshold=0.0",
        ],
        cwd=tmp_path,
    )
    (run,) = (tmp_path / "runs" / "predict").glob("*/")
    assert "6 classes from ckpt_path=" in (run / "predict.log").read_text()
    index = json.loads((run / "predictions_images.json").read_text())
    assert index["images"] == [
        {"id": k + 1, "file_name": name, "height": sizes[name][0], "width": sizes[name][1]}
        for k, name in enumerate(sorted(sizes))
    ]
    assert [c["name"] for c in index["categories"]] == [
        "circle",
        "square",
        "triangle",
        "star",
        "ring",
        "cross",
    ]
    assert [c["id"] for c in index["categories"]] == [1, 2, 3, 4, 5, 6]
    dataset = COCO()
    dataset.dataset = {**index, "annotations": []}
    dataset.createIndex()
    records = json.loads((run / "predictions.json").read_text())
    assert records and {r["image_id"] for r in records} <= {1, 2, 3}
    results = dataset.loadRes(str(run / "predictions.json"))  # the official loader takes the pair
    assert set(results.getImgIds()) <= {1, 2, 3} and set(results.getCatIds()) <= set(dataset.getCatIds())
    pictures = sorted(p.name for p in (run / "predictions").glob("*.png"))
    assert pictures == ["1_a_street.png", "2_b_night.png", "3_c_scan.png"]


def test_help_lists_subcommands_and_groups(tmp_path: Path) -> None:
    out = run_cli(["--help"], cwd=tmp_path).stdout
    for word in (
        "fit",
        "validate",
        "test",
        "predict",
        "model",
        "data",
        "trainer",
        "callbacks",
        "logger",
        "optim",
        "speedups",
        "experiment",
        "maskrcnn_light",
        "coco_r50_fpn",
        "bf16-mixed",
    ):
        assert word in out
    script = Path(sys.executable).parent / "lit-amp-det"
    assert script.is_file(), "the console script is installed with the package"


def test_cfg_job_prints_the_composed_config(tmp_path: Path) -> None:
    out = run_cli(["test", "--cfg", "job", "trainer.precision=16-mixed"], cwd=tmp_path).stdout
    cfg = OmegaConf.create(out)
    assert cfg.command == "test" and cfg.trainer.precision == "16-mixed"
    assert cfg.model._target_ == "lit_amp_det.MaskRCNNModule"


@pytest.mark.slow
def test_unknown_subcommand_and_bad_precision_fail_clearly(tmp_path: Path) -> None:
    proc = run_cli(["train"], cwd=tmp_path, check=False)
    assert proc.returncode != 0 and "unknown subcommand 'train'" in proc.stderr
    proc = run_cli(["fit", *SMOKE, "trainer.precision=fp16"], cwd=tmp_path, check=False)
    assert proc.returncode != 0 and "trainer.precision='fp16'" in proc.stderr


@pytest.mark.slow
def test_multirun_sweeps_precision(tmp_path: Path) -> None:
    run_cli(["fit", "-m", *SMOKE, "trainer.max_epochs=1", "trainer.precision=32-true,16-mixed"], cwd=tmp_path)
    jobs = sorted((tmp_path / "runs" / "multirun").glob("*/*/metrics.json"))
    assert len(jobs) == 2
    precisions = {OmegaConf.load(j.parent / "config_resolved.yaml").trainer.precision for j in jobs}
    assert precisions == {"32-true", "16-mixed"}


@pytest.mark.slow
def test_research_subclass_runs_from_the_cli(tmp_path: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "examples"), os.environ.get("PYTHONPATH", "")])}
    run_cli(
        [
            "fit",
            *SMOKE,
            "trainer.max_epochs=1",
            "model._target_=weighted_loss.WeightedLossMaskRCNN",
            "+model.loss_weights.loss_mask=2.0",
        ],
        cwd=tmp_path,
        env=env,
    )
    run_dir = only_run_dir(tmp_path / "runs")
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert checkpoint["hyper_parameters"]["loss_weights"] == {"loss_mask": 2.0}
    assert any("mask_head.0.1.weight" in key for key in checkpoint["state_dict"])  # its GroupNorm head


@pytest.mark.slow
def test_bad_annotations_fail_clearly_and_keep_earlier_outputs(tmp_path: Path) -> None:
    root = tmp_path / "coco"
    (root / "annotations").mkdir(parents=True)
    (root / "train2017").mkdir()
    (root / "val2017").mkdir()
    (root / "annotations" / "instances_train2017.json").write_text('{"images": [}')
    run_dir = tmp_path / "runs" / "fit" / "earlier"  # an earlier run, next to the one that fails
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"earlier checkpoint")
    (run_dir / "metrics.json").write_text('{"earlier": true}')
    proc = run_cli(
        ["fit", "model=maskrcnn_tiny", "data=coco", f"data.root={root}"], cwd=tmp_path, check=False
    )
    assert proc.returncode != 0
    assert "instances_train2017.json" in proc.stderr and "not valid JSON" in proc.stderr
    assert (run_dir / "checkpoints" / "last.ckpt").read_bytes() == b"earlier checkpoint"
    assert json.loads((run_dir / "metrics.json").read_text()) == {"earlier": True}

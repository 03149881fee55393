"""Which classes ``predict`` on a folder of pictures gives the model (``lit_amp_det.app.model_classes``): the
checkpoint's, the named weights', else the data's; and a COCO data module without ``data.root`` that reads no
split. (The CLI run without the training data: ``test_cli.py``; torchvision's COCO weights on a folder:
``test_weights.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import compose_config
from lit_amp_det.app.model_classes import folder_prediction_classes, predicts_on_a_folder, weights_classes
from lit_amp_det.app.tasks import build_datamodule, build_model
from lit_amp_det.checkpoints import saved_classes
from lit_amp_det.data import CocoDataModule, ShapesDataModule
from lit_amp_det.errors import ArgumentError
from test_predict_folder import pictures_folder

CLASSES = {"num_classes": 3, "class_names": ["cat", "dog"], "category_ids": [17, 18]}


def _lightning_file(path: Path, hparams: dict) -> Path:
    torch.save({"state_dict": {"model.w": torch.zeros(1)}, "hyper_parameters": hparams}, path)
    return path


def test_saved_classes_reads_a_lightning_checkpoint_s_hyper_parameters() -> None:
    assert saved_classes({"hyper_parameters": {**CLASSES, "mask": True}}) == CLASSES
    saved = saved_classes(
        {"hyper_parameters": {"num_classes": 3, "class_names": ("cat", "dog"), "category_ids": None}}
    )
    assert saved == {"num_classes": 3, "class_names": ["cat", "dog"]}  # tuples as lists, unset keys left out
    assert saved_classes({"w": torch.zeros(1)}) == {}  # a bare state dict names no classes
    assert saved_classes({"state_dict": {}, "hyper_parameters": {"lr": 0.1}}) == {}
    assert saved_classes(None) == {}


def test_torchvision_coco_weights_name_their_91_labels() -> None:
    for name in ("COCO_V1", "DEFAULT"):
        classes = weights_classes(name, mask=True)
        assert classes["num_classes"] == 91 and classes["category_ids"] == list(range(1, 91))
        assert (
            classes["class_names"][:3] == ["person", "bicycle", "car"] and len(classes["class_names"]) == 90
        )
    assert weights_classes("COCO_V1", mask=False)["num_classes"] == 91  # Faster R-CNN's file
    with pytest.raises(ArgumentError, match=r"model\.weights='COCO_V9'"):
        weights_classes("COCO_V9", mask=True)


def test_the_checkpoint_then_a_weights_file_then_named_weights_name_the_classes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = _lightning_file(tmp_path / "fit.ckpt", CLASSES)
    other = _lightning_file(tmp_path / "other.ckpt", {"num_classes": 5, "class_names": list("abcd")})
    folder = ["command=predict", "data.predict_images=pics"]
    cfg = compose_config([*folder, "model=maskrcnn_r50_fpn", f"model.weights={other}"], tmp_path)
    assert predicts_on_a_folder(cfg)
    assert folder_prediction_classes(cfg, str(ckpt)) == CLASSES
    assert folder_prediction_classes(cfg, None) == {"num_classes": 5, "class_names": list("abcd")}
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg.model.weights = "~/other.ckpt"  # the file the module would load
    assert folder_prediction_classes(cfg, None) == {"num_classes": 5, "class_names": list("abcd")}
    cfg.model.weights = "COCO_V1"
    assert folder_prediction_classes(cfg, str(ckpt)) == CLASSES
    assert folder_prediction_classes(cfg, None)["num_classes"] == 91
    cfg.model.weights = None
    assert folder_prediction_classes(cfg, None) is None  # no weights name them: the data does
    bare = tmp_path / "bare.pt"
    torch.save({"w": torch.zeros(1)}, bare)
    cfg.model.weights = str(bare)
    assert folder_prediction_classes(cfg, None) is None


def test_a_class_setting_of_the_model_config_wins(tmp_path: Path) -> None:
    ckpt = _lightning_file(tmp_path / "fit.ckpt", CLASSES)
    cfg = compose_config(
        ["command=predict", "data.predict_images=pics", "model.class_names=[Cat,Dog]"], tmp_path
    )
    assert folder_prediction_classes(cfg, str(ckpt)) == {"num_classes": 3, "category_ids": [17, 18]}


def test_only_predict_on_a_folder_takes_the_classes_from_the_weights(tmp_path: Path) -> None:
    assert not predicts_on_a_folder(compose_config(["command=predict"], tmp_path))
    assert not predicts_on_a_folder(compose_config(["command=test", "data.predict_images=pics"], tmp_path))


def test_a_folder_prediction_with_named_classes_reads_no_split(tmp_path: Path) -> None:
    pictures_folder(tmp_path / "pictures")
    cfg = compose_config(
        [
            "command=predict",
            "data=coco",
            "model=maskrcnn_tiny",
            "data.num_workers=0",
            f"data.predict_images={tmp_path / 'pictures'}",
        ],
        tmp_path,
    )
    datamodule = build_datamodule(cfg)
    module = build_model(cfg, datamodule, classes=CLASSES)
    assert (module.hparams.num_classes, module.hparams.category_ids) == (3, [17, 18])
    datamodule.setup("predict")
    assert datamodule.datasets == {} and len(datamodule.predict_folder()) == 3
    images, _ = next(iter(datamodule.predict_dataloader()))
    assert len(images) == 2


def test_without_data_root_a_split_names_the_setting(tmp_path: Path) -> None:
    cfg = compose_config(["command=fit", "data=coco", "model=maskrcnn_tiny"], tmp_path)
    datamodule = build_datamodule(cfg)
    with pytest.raises(
        ArgumentError,
        match=r"^data\.root=None .*'train2017'",
    ):
        build_model(cfg, datamodule)


def test_without_root_absolute_split_paths_are_read(tmp_path: Path) -> None:
    shapes = ShapesDataModule(tmp_path / "cache", train_size=4, val_size=2, test_size=2, image_size=64)
    shapes.prepare_data()
    datamodule = CocoDataModule(
        train_images=str(shapes.root / "images/train"),
        train_annotations=str(shapes.root / "annotations/instances_train.json"),
    )
    assert datamodule.root is None and datamodule.num_classes == 7 and len(datamodule.dataset("train")) == 4


def test_predict_on_a_folder_with_the_shapes_data_generates_no_split(tmp_path: Path) -> None:
    """The shapes data is generated for the splits a run reads; ``predict`` on a folder with classes from a
    checkpoint reads none, so nothing is generated (a fresh machine predicting with a trained model).
    """
    from lightning.pytorch import Trainer

    pictures_folder(tmp_path / "pictures")
    cfg = compose_config(
        [
            "command=predict",
            "model=maskrcnn_tiny",
            "data.num_workers=0",
            "data.train_size=4",
            "data.val_size=2",
            "data.test_size=2",
            "data.image_size=64",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"data.predict_images={tmp_path / 'pictures'}",
        ],
        tmp_path,
    )
    datamodule = build_datamodule(cfg)
    assert isinstance(datamodule, ShapesDataModule)
    module = build_model(cfg, datamodule, classes=CLASSES)
    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    predictions = trainer.predict(module, datamodule=datamodule)
    assert sum(len(batch) for batch in predictions) == 3
    assert list((tmp_path / "cache").glob("shapes-*")) == []  # (the pictures' verification cache is there)
    assert datamodule.num_classes == 7 and list(
        (tmp_path / "cache").glob("shapes-*")
    )  # classes read: generated

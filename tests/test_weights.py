"""Pretrained weights by torchvision name, from torch hub's cache, without the network.

Every test runs with DNS and socket connections refused. The "published" files are random state dicts of the
right architecture written under torchvision's file names into a temporary ``$TORCH_HOME/hub/checkpoints/``,
so a loaded model can be compared tensor by tensor with the file.
"""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from torch import Tensor, nn
from torchvision.models import ResNet18_Weights, ResNet50_Weights, WeightsEnum, resnet18
from torchvision.models.detection import (
    FasterRCNN_ResNet50_FPN_Weights,
    MaskRCNN_ResNet50_FPN_Weights,
    fasterrcnn_resnet50_fpn,
    maskrcnn_resnet50_fpn,
)

from conftest import CONFIG_ERRORS, compose_config
from lit_amp_det.app.tasks import build_datamodule, build_model, build_trainer
from lit_amp_det.checkpoints import local_weights
from lit_amp_det.data import ShapesDataModule
from lit_amp_det.errors import ArgumentError
from lit_amp_det.models import build_backbone, build_detector
from lit_amp_det.models.norms import FrozenBatchNorm2d
from lit_amp_det.models.weights import (
    CLASS_DEPENDENT,
    WeightsMismatchError,
    WeightsUnavailableError,
    cached_file,
    resolve_weights,
)

#: The R50-FPN settings of conf/model/maskrcnn_r50_fpn.yaml, for direct builder calls.
R50_FPN = dict(
    backbone=dict(name="resnet50", fpn_channels=256, trainable_layers=3, norm="frozen_bn"),
    roi_heads=dict(box_head_width=1024, mask_head_layers=[256, 256, 256, 256]),
)


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network access is blocked in tests/test_weights.py")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


def _random_state(model: nn.Module, seed: int) -> dict[str, Tensor]:
    """Random values for every float tensor of ``model`` (built on the meta device), no step counters: a
    stand-in for a published file that no initialisation could reproduce (small enough that activations stay
    finite).
    """
    gen = torch.Generator().manual_seed(seed)
    return {
        key: torch.rand(value.shape, generator=gen) + 0.5
        if key.endswith("running_var")
        else 0.05 * torch.randn(value.shape, generator=gen)
        for key, value in model.state_dict().items()
        if value.is_floating_point()
    }


@pytest.fixture(scope="module")
def torch_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hub cache holding resnet18 ImageNet and the two R50-FPN COCO files, under torchvision's names."""
    home = tmp_path_factory.mktemp("torch_home")
    checkpoints = home / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    with torch.device("meta"):
        models = {
            ResNet18_Weights.IMAGENET1K_V1: resnet18(),
            MaskRCNN_ResNet50_FPN_Weights.COCO_V1: maskrcnn_resnet50_fpn(weights=None, weights_backbone=None),
            FasterRCNN_ResNet50_FPN_Weights.COCO_V1: fasterrcnn_resnet50_fpn(
                weights=None, weights_backbone=None
            ),
        }
    for seed, (weights, model) in enumerate(models.items()):
        torch.save(_random_state(model, seed), checkpoints / Path(weights.url).name)
    return home


@pytest.fixture
def cached(torch_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$TORCH_HOME points at the prepared cache; any download attempt fails the test."""
    monkeypatch.setenv("TORCH_HOME", str(torch_home))

    def no_download(url: str, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"{url} is cached: nothing may be downloaded")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_download)
    return torch_home


def _file(weights: WeightsEnum) -> dict[str, Tensor]:
    """The state dict of the cached file of ``weights``."""
    return torch.load(cached_file(weights), map_location="cpu", weights_only=True)


def _assert_loaded(module: nn.Module, saved: dict[str, Tensor], skip: tuple[str, ...] = ()) -> int:
    """Every tensor of ``saved`` (but ``skip`` prefixes) equals the module's; returns how many were
    compared.
    """
    own = module.state_dict()
    compared = 0
    for key, value in saved.items():
        if key.startswith(skip) or (
            key not in own and key.startswith("fc.")
        ):  # FPN backbones drop the classifier
            continue
        assert torch.equal(own[key], value), key
        compared += 1
    return compared


# ------------------------------------------------------------------------------------------ names
def test_names_resolve_through_torchvisions_enums() -> None:
    assert resolve_weights(ResNet50_Weights, "DEFAULT", "f") is ResNet50_Weights.IMAGENET1K_V2
    assert (
        resolve_weights(ResNet50_Weights, "ResNet50_Weights.IMAGENET1K_V1", "f")
        is ResNet50_Weights.IMAGENET1K_V1
    )
    with pytest.raises(
        ArgumentError,
        match=r"^weights='IMAGENET1K_V3' is not one of torchvision's "
        r"ResNet50_Weights; choose one of \['IMAGENET1K_V1', 'IMAGENET1K_V2', "
        r"'DEFAULT'\] \(DEFAULT is IMAGENET1K_V2\)",
    ):
        build_backbone("resnet50", weights="IMAGENET1K_V3")
    with pytest.raises(
        ArgumentError,
        match=r"^weights='COCO_V2' is not one of torchvision's "
        r"MaskRCNN_ResNet50_FPN_Weights; choose one of \['COCO_V1', 'DEFAULT'\]",
    ):
        build_detector(91, weights="COCO_V2", **R50_FPN)
    with pytest.raises(
        ArgumentError,
        match=r"^weights='IMAGENET1K_V1' cannot be used: torchvision publishes no weights "
        r"for name='resnet10'",
    ):
        build_backbone("resnet10", weights="IMAGENET1K_V1")


def test_weights_for_another_architecture_name_every_mismatch() -> None:
    with pytest.raises(
        WeightsMismatchError,
        match=r"^weights='COCO_V1' names torchvision's maskrcnn_resnet50_fpn "
        r"checkpoint \(MaskRCNN_ResNet50_FPN_Weights\), which this model does not "
        r"match: backbone.fpn_channels=128 \(needs 256\), "
        r"roi_heads.mask_head_layers=\[64,64\] \(needs \[256,256,256,256\]\)",
    ):
        build_detector(
            91,
            weights="COCO_V1",
            backbone=dict(R50_FPN["backbone"], fpn_channels=128),
            roi_heads=dict(box_head_width=1024, mask_head_layers=[64, 64]),
        )


# ------------------------------------------------------------------------------------- backbone
@pytest.mark.parametrize("norm", ["frozen_bn", "bn"])
def test_backbone_imagenet_weights_load_by_name(norm: str, cached: Path) -> None:
    body = build_backbone("resnet18", weights="IMAGENET1K_V1", norm=norm, trainable_layers=3).body
    saved = _file(ResNet18_Weights.IMAGENET1K_V1)
    assert _assert_loaded(body, saved) == len(saved) - 2  # all but fc.weight and fc.bias
    norm_type = FrozenBatchNorm2d if norm == "frozen_bn" else nn.BatchNorm2d
    assert type(body.layer1[0].bn1) is norm_type and type(body.bn1) is norm_type
    # loaded before freezing: the stages below the trainable three stay frozen
    assert not body.layer1[0].conv1.weight.requires_grad and body.layer2[0].conv1.weight.requires_grad


@pytest.mark.parametrize("name", ["IMAGENET1K_V1", "DEFAULT"])  # resnet18's DEFAULT is IMAGENET1K_V1
def test_backbone_weights_given_on_the_command_line_reach_the_builder(
    name: str, cached: Path, tmp_path: Path
) -> None:
    cfg = compose_config([f"model.backbone.weights={name}"], tmp_path)  # maskrcnn_light: resnet18
    module = instantiate(cfg.model, num_classes=8)
    saved = _file(ResNet18_Weights.IMAGENET1K_V1)
    assert _assert_loaded(module.model.backbone.body, saved) == len(saved) - 2


# ------------------------------------------------------------------------------------ detectors
def test_coco_weights_load_by_name_through_the_r50_config(cached: Path, tmp_path: Path) -> None:
    cfg = compose_config(["model=maskrcnn_r50_fpn", "model.weights=COCO_V1"], tmp_path)
    module = instantiate(cfg.model, num_classes=91)
    saved = _file(MaskRCNN_ResNet50_FPN_Weights.COCO_V1)
    assert _assert_loaded(module.model, saved) == len(saved)
    assert isinstance(module.model.backbone.body.layer4[0].bn1, FrozenBatchNorm2d)


def test_faster_rcnn_takes_the_faster_rcnn_checkpoint(cached: Path, tmp_path: Path) -> None:
    cfg = compose_config(["model=maskrcnn_r50_fpn", "model.mask=false", "model.weights=COCO_V1"], tmp_path)
    module = instantiate(cfg.model, num_classes=91)
    saved = _file(FasterRCNN_ResNet50_FPN_Weights.COCO_V1)
    assert _assert_loaded(module.model, saved) == len(saved)


def test_another_class_count_reinitialises_only_the_predictors(
    cached: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="lit_amp_det.models.weights"):
        detector = build_detector(8, weights="COCO_V1", **R50_FPN)
    saved = _file(MaskRCNN_ResNet50_FPN_Weights.COCO_V1)
    skipped = [k for k in saved if k.startswith(CLASS_DEPENDENT)]
    assert len(skipped) == 6
    assert _assert_loaded(detector, saved, skip=CLASS_DEPENDENT) == len(saved) - 6
    own = detector.state_dict()
    assert own["roi_heads.box_predictor.cls_score.weight"].shape == (8, 1024)
    assert own["roi_heads.box_predictor.bbox_pred.weight"].shape == (32, 1024)
    assert own["roi_heads.mask_predictor.mask_fcn_logits.weight"].shape == (8, 256, 1, 1)
    # fresh initialisations (uniform within 1 / sqrt(fan_in)), not the file's values
    assert own["roi_heads.box_predictor.cls_score.weight"].abs().max() <= 1 / 32
    assert own["roi_heads.box_predictor.bbox_pred.bias"].abs().max() <= 1 / 32
    assert own["roi_heads.mask_predictor.mask_fcn_logits.bias"].abs().max() <= 1 / 16
    (line,) = [r.getMessage() for r in caplog.records if "re-initialised" in r.getMessage()]
    assert (
        "weights='COCO_V1': loaded 301 tensors of maskrcnn_resnet50_fpn_coco-bf2d0c1e.pth" in line
        and "roi_heads.box_predictor.bbox_pred, roi_heads.box_predictor.cls_score, "
        "roi_heads.mask_predictor.mask_fcn_logits re-initialised for 8 classes (the checkpoint has 91)"
        in line
    )


def test_a_file_that_does_not_fit_names_the_tensors(
    cached: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved = _file(ResNet18_Weights.IMAGENET1K_V1)
    del saved["layer4.1.conv2.weight"]
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # a cache of its own, holding the damaged file
    cached_file(ResNet18_Weights.IMAGENET1K_V1).parent.mkdir(parents=True)
    torch.save(saved, cached_file(ResNet18_Weights.IMAGENET1K_V1))
    with pytest.raises(
        WeightsMismatchError,
        match=r"^weights='IMAGENET1K_V1' does not fit the model: "
        r"resnet18-f37072fd.pth has 1 tensors missing from the "
        r"file \(layer4.1.conv2.weight\)",
    ):
        build_backbone("resnet18", weights="IMAGENET1K_V1")


# ------------------------------------------------------------------------------ offline and cache
def test_offline_cache_miss_names_file_url_and_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        "TORCH_HOME", str(tmp_path / "torch")
    )  # empty cache; torch hub's real download is tried
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    with pytest.raises(WeightsUnavailableError) as info:
        build_backbone("resnet18", weights="IMAGENET1K_V1")
    message = str(info.value)
    assert message.startswith(
        "weights='IMAGENET1K_V1' needs resnet18-f37072fd.pth, which is not in "
        "the torch hub cache, and downloading it from "
        "https://download.pytorch.org/models/resnet18-f37072fd.pth failed (URLError: "
    )
    assert f"put the file into {folder}/" in message and "network access is blocked" in message
    assert list(folder.iterdir()) == []  # no partial file left behind


def test_an_unreadable_cached_file_says_to_replace_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    path = cached_file(MaskRCNN_ResNet50_FPN_Weights.COCO_V1)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"<html>proxy login page</html>")
    with pytest.raises(WeightsUnavailableError) as info:
        build_detector(91, weights="DEFAULT", **R50_FPN)
    assert str(info.value) == (
        f"weights='DEFAULT' cannot be loaded: the cached file {path} is unreadable (UnpicklingError; "
        "29 bytes starting with b'<html>pr'): it is truncated or not the published checkpoint. Delete it "
        "to download it again, or replace it with a complete copy of https://download.pytorch.org/models/maskrcnn_resnet50_fpn_coco-bf2d0c1e.pth"
    )


def test_a_local_weights_file_replaces_the_backbone_weights_and_nothing_is_fetched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # empty cache, no network: a fetch would fail
    cfg = compose_config(["model=maskrcnn_tiny", "model.backbone.name=resnet18"], tmp_path)
    source = instantiate(cfg.model, num_classes=4)
    torch.save(source.model.state_dict(), tmp_path / "mine.pt")
    cfg = compose_config(
        [
            "model=maskrcnn_tiny",
            "model.backbone.name=resnet18",
            "model.backbone.weights=IMAGENET1K_V1",
            f"model.weights={tmp_path / 'mine.pt'}",
        ],
        tmp_path,
    )
    with caplog.at_level(logging.INFO, logger="lit_amp_det.module"):
        module = instantiate(cfg.model, num_classes=4)
    assert _assert_loaded(module.model, source.model.state_dict()) == len(source.model.state_dict())
    (line,) = [r.getMessage() for r in caplog.records if "supplies the weights" in r.getMessage()]
    assert str(tmp_path / "mine.pt") in line
    assert "supplies the weights: backbone.weights='IMAGENET1K_V1' checked but not loaded" in line
    # the names are still checked
    cfg.model.backbone.weights = "IMAGENET1K_V9"
    with pytest.raises(CONFIG_ERRORS, match=r"backbone.weights='IMAGENET1K_V9' is not one of"):
        instantiate(cfg.model, num_classes=4)


@pytest.mark.parametrize(
    ("weights", "path"),
    [
        (None, None),
        ("COCO_V1", None),
        ("DEFAULT", None),
        ("MaskRCNN_ResNet50_FPN_Weights.COCO_V1", None),
        (
            "runs/fit/2024-01-01_00-00-00/checkpoints/last.ckpt",
            "runs/fit/2024-01-01_00-00-00/checkpoints/last.ckpt",
        ),
        ("./model", "model"),
        ("mine.pt", "mine.pt"),
        ("MINE.PTH", "MINE.PTH"),
        ("detector.bin", "detector.bin"),
        ("archive.tar", "archive.tar"),
        ("~/weights/coco", str(Path.home() / "weights/coco")),
        (Path("plain_name"), "plain_name"),
    ],
)
def test_model_weights_is_a_local_file_when_it_looks_like_one(weights: object, path: str | None) -> None:
    """A directory part or a checkpoint ending makes a file; torchvision's names have neither."""
    assert local_weights(weights) == (None if path is None else Path(path))


# ----------------------------------------------------------------------------- the experiment
def test_finetune_coco_trains_a_step_on_own_coco_data(cached: Path, tmp_path: Path, cache_dir: Path) -> None:
    """experiment=finetune_coco on a small COCO-format folder (the embedded shapes data, 6 classes): COCO
    weights but the predictors, and the lr scaled from 0.01 for 16 images to a global batch of 2.
    """
    shapes = ShapesDataModule(cache_dir, train_size=4, val_size=2, test_size=2, image_size=64)
    shapes.prepare_data()
    cfg = compose_config(
        [
            "experiment=finetune_coco",
            f"data.root={shapes.root}",
            "trainer=cpu",
            "trainer.precision=32-true",
            "data.train_images=images/train",
            "data.train_annotations=annotations/instances_train.json",
            "data.val_images=images/val",
            "data.val_annotations=annotations/instances_val.json",
            "data.num_workers=0",
            "model.transform.min_size=64",
            "model.transform.max_size=64",
            "model.rpn.pre_nms_top_n_train=200",
            "model.rpn.post_nms_top_n_train=100",  # sampling only: a fast step
            "model.roi_heads.batch_size_per_image=32",
            "trainer.max_steps=1",
            "trainer.num_sanity_val_steps=0",
            "trainer.enable_progress_bar=false",
            "callbacks=none",
            "logger=none",
        ],
        tmp_path / "run",
    )
    datamodule = build_datamodule(cfg)
    module = build_model(cfg, datamodule)
    assert module.hparams.num_classes == 7 and module.hparams.weights == "COCO_V1"  # 6 shapes + background
    saved = _file(MaskRCNN_ResNet50_FPN_Weights.COCO_V1)
    assert _assert_loaded(module.model, saved, skip=CLASS_DEPENDENT) == len(saved) - 6

    trainer = build_trainer(cfg)
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 1
    # no warm-up in a 1-step run (5% of it): the scaled lr itself
    assert trainer.optimizers[0].param_groups[0]["initial_lr"] == pytest.approx(0.01 * 2 / 16)
    assert float(trainer.callback_metrics["train/lr"]) == pytest.approx(0.01 * 2 / 16)


def test_coco_weights_predict_a_folder_under_coco_s_own_classes(
    cached: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``predict model.weights=COCO_V1 data=coco data.predict_images=DIR`` without ``data.root``:
    torchvision's COCO model on one's own pictures. Its 91 labels (label ``i`` is COCO category id ``i``),
    every tensor loaded, the predictors included; no annotations anywhere.
    """
    from lit_amp_det.app.tasks import predict
    from test_predict_folder import pictures_folder

    pictures_folder(tmp_path / "pictures")
    cfg = compose_config(
        [
            "command=predict",
            "model=maskrcnn_r50_fpn",
            "model.weights=COCO_V1",
            "data=coco",
            f"data.predict_images={tmp_path / 'pictures'}",
            "data.num_workers=0",
            "model.transform.min_size=64",
            "model.transform.max_size=64",
            "trainer=cpu",
            "trainer.precision=32-true",
            "logger=none",
            "trainer.enable_progress_bar=false",
            "callbacks.prediction_writer.num_images=0",
            "model.roi_heads.score_thresh=0.0",  # the random file's scores are low: keep every detection
        ],
        tmp_path / "run",
    )
    with caplog.at_level(logging.INFO):
        predict(cfg)
    messages = [r.getMessage() for r in caplog.records]
    assert "predict on data.predict_images: 90 classes from model.weights=COCO_V1" in messages
    assert any(
        m.startswith("weights='COCO_V1': loaded maskrcnn_resnet50_fpn_coco-bf2d0c1e.pth") for m in messages
    )
    assert not any("re-initialised" in m for m in messages)
    index = json.loads((tmp_path / "run" / "predictions_images.json").read_text())
    categories = {c["id"]: c["name"] for c in index["categories"]}
    assert len(categories) == 80 and categories[1] == "person" and categories[90] == "toothbrush"
    assert 12 not in categories  # an id COCO does not use (torchvision names it N/A): no category
    assert [image["file_name"] for image in index["images"]] == ["a_street.JPG", "b_night.png", "c_scan.bmp"]
    records = json.loads((tmp_path / "run" / "predictions.json").read_text())
    assert records and {r["category_id"] for r in records} <= set(range(1, 91))
    assert len({r["category_id"] for r in records}) > 1

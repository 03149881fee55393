"""Every config group composes and instantiates; bad values fail early with the field named."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from urllib.error import URLError

import lightning.pytorch as pl
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import CONFIG_ERRORS, compose_config
from lit_amp_det import MaskRCNNModule
from lit_amp_det.app.config import check_config, config_groups
from lit_amp_det.app.tasks import build_model, build_trainer
from lit_amp_det.errors import ArgumentError

GROUPS = config_groups()


def test_expected_groups_exist() -> None:
    for group in (
        "model",
        "speedups",
        "data",
        "trainer",
        "precision",
        "callbacks",
        "logger",
        "optim",
        "experiment",
        "hydra",
        "paths",
    ):
        assert group in GROUPS and GROUPS[group], group


@pytest.mark.parametrize("option", GROUPS["model"])
def test_every_model_instantiates(option: str, tmp_path: Path) -> None:
    cfg = compose_config([f"model={option}"], tmp_path)
    module = instantiate(cfg.model, num_classes=3)
    assert isinstance(module, MaskRCNNModule)
    assert module.hparams.mask == (option != "fasterrcnn_light")
    assert hasattr(module.model.roi_heads, "mask_head") and (module.model.roi_heads.mask_head is None) == (
        option == "fasterrcnn_light"
    )


#: What each conf/speedups option names, and what of it applies to a model on a CPU.
SPEEDUPS = {
    "default": (["ext_ops", "binary_mask_paste", "sync_free"], ["ext_ops", "binary_mask_paste"]),
    "gpu": (
        ["ext_ops", "binary_mask_paste", "sync_free", "channels_last", "compile"],
        ["ext_ops", "binary_mask_paste"],
    ),
    "none": ([], []),
}


def test_every_speedups_option_is_tested() -> None:
    assert sorted(GROUPS["speedups"]) == sorted(SPEEDUPS)


@pytest.mark.parametrize("option", GROUPS["speedups"])
def test_every_speedups_option_instantiates(option: str, tmp_path: Path) -> None:
    cfg = compose_config(["experiment=smoke", f"speedups={option}"], tmp_path)
    assert cfg.model.speedups == cfg.speedups  # the model node reads the group
    module = instantiate(cfg.model, num_classes=3)
    named, on_cpu = SPEEDUPS[option]
    assert [t.name for t in module.configured_speedups] == named
    module.configure_model()
    assert module.applied_speedups == on_cpu
    assert module.hparams.speedups == OmegaConf.to_container(cfg.speedups)  # plain data in every checkpoint


@pytest.mark.parametrize("option", GROUPS["data"])
def test_every_data_module_instantiates(option: str, tmp_path: Path) -> None:
    overrides = [f"data={option}"] + ([f"data.root={tmp_path}"] if option == "coco" else [])
    datamodule = instantiate(compose_config(overrides, tmp_path).data)
    assert isinstance(datamodule, pl.LightningDataModule)


@pytest.mark.parametrize("group", ["trainer", "precision", "callbacks", "logger", "optim"])
def test_every_option_of_runtime_groups_instantiates(group: str, tmp_path: Path) -> None:
    assert GROUPS[group], f"conf/{group}/ has no options"
    for option in GROUPS[group]:
        cfg = compose_config([f"{group}={option}"], tmp_path)
        if group == "optim":
            module = instantiate(cfg.model, num_classes=3)
            module._trainer = SimpleNamespace(estimated_stepping_batches=10)  # all the schedule needs
            out = module.configure_optimizers()
            assert type(out["optimizer"]).__name__ == cfg.optim.optimizer._target_.rsplit(".", 1)[1]
            assert out["lr_scheduler"]["interval"] == "step"
        elif group == "trainer" and option == "gpu":
            continue  # needs a GPU to instantiate; composes above
        else:
            trainer = build_trainer(cfg)
            assert isinstance(trainer, pl.Trainer)
            callback_names = {type(c).__name__ for c in trainer.callbacks}
            if group == "callbacks" and option == "default":
                assert {"ModelCheckpoint", "RNGStateCheckpoint", "CocoPredictionWriter"} <= callback_names
                assert len(trainer.checkpoint_callbacks) == 2  # best-by-metric and last
            if group == "logger" and option != "none":
                assert trainer.loggers, option


def _offline(url: str, *args: object, **kwargs: object) -> None:
    raise URLError(f"no network in tests ({url})")


@pytest.mark.parametrize("option", GROUPS["experiment"])
def test_every_experiment_composes(option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = ["data.root=/data/coco"] if "coco" in option else []
    cfg = compose_config([f"experiment={option}", *root], tmp_path)
    check_config(cfg)
    # an empty weights cache and no network: named weights get as far as the download (names and architecture
    # checked); tests/test_weights.py loads them from a prepared cache
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(torch.hub, "download_url_to_file", _offline)
    if cfg.model.weights or cfg.model.backbone.weights:
        with pytest.raises(CONFIG_ERRORS, match="which is not in the torch hub cache"):
            instantiate(cfg.model, num_classes=3)
    else:
        instantiate(cfg.model, num_classes=3)


def test_coco_r50_fpn_is_the_real_setting(tmp_path: Path) -> None:
    cfg = compose_config(["experiment=coco_r50_fpn", "data.root=/data/coco"], tmp_path)
    assert cfg.model.backbone.name == "resnet50" and cfg.model.transform.min_size == 800
    assert cfg.model.transform.max_size == 1333 and cfg.trainer.accelerator == "gpu"
    assert cfg.data._target_.endswith("CocoDataModule")


def test_headline_metric_follows_the_mask_switch(tmp_path: Path) -> None:
    assert compose_config([], tmp_path).optimized_metric == "val/segm_mAP"
    assert compose_config(["model.mask=false"], tmp_path).optimized_metric == "val/bbox_mAP"


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed"])
def test_precisions_are_accepted(precision: str, tmp_path: Path) -> None:
    check_config(compose_config([f"trainer.precision={precision}"], tmp_path))


def test_the_common_trainer_settings_are_plain_overrides(tmp_path: Path) -> None:
    """What a Lightning user passes to the Trainer, and what the README names, needs no ``+`` (Hydra refuses a
    key the config lacks without one): the values reach the Trainer.
    """
    cfg = compose_config(
        [
            "trainer.accumulate_grad_batches=2",
            "trainer.gradient_clip_val=0.5",
            "trainer.gradient_clip_algorithm=value",
        ],
        tmp_path,
    )
    trainer = build_trainer(cfg)
    assert trainer.accumulate_grad_batches == 2
    assert (trainer.gradient_clip_val, trainer.gradient_clip_algorithm) == (0.5, "value")
    default = build_trainer(compose_config([], tmp_path))
    assert default.accumulate_grad_batches == 1 and default.gradient_clip_val is None


def test_data_settings_of_another_data_option_name_the_keys(tmp_path: Path) -> None:
    """``experiment=smoke data=coco``: the smoke experiment's shapes settings reach CocoDataModule, which
    would fail in ``instantiate`` as an unexpected keyword argument; the check names every such key and the
    way out.
    """
    with pytest.raises(
        CONFIG_ERRORS,
        match=r"data.image_size, data.test_size, data.train_size, data.val_size: not a "
        r"setting of CocoDataModule.*experiment=smoke.*CocoDataModule takes: root",
    ):
        check_config(compose_config(["experiment=smoke", "data=coco"], tmp_path))
    check_config(compose_config(["data=coco"], tmp_path))  # the option's own keys pass
    check_config(compose_config(["experiment=smoke"], tmp_path))


def test_bad_precision_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(CONFIG_ERRORS, match=r"trainer.precision='16'.*32-true, 16-mixed, bf16-mixed"):
        check_config(compose_config(["trainer.precision=16"], tmp_path))


def test_weights_for_another_architecture_name_the_mismatch(tmp_path: Path) -> None:
    datamodule = SimpleNamespace(num_classes=3)
    cfg = compose_config(["model.weights=COCO_V1"], tmp_path)  # maskrcnn_light: R18, 64-wide FPN, slim heads
    with pytest.raises(
        ArgumentError,
        match=r"^model.weights='COCO_V1' names torchvision's maskrcnn_resnet50_fpn.*"
        r"backbone.name=resnet18 \(needs resnet50\)",
    ):
        build_model(cfg, datamodule)
    cfg = compose_config(["model=maskrcnn_tiny", "model.backbone.weights=IMAGENET1K_V1"], tmp_path)
    with pytest.raises(
        ArgumentError,
        match=r"^model.backbone.weights='IMAGENET1K_V1' cannot be used: torchvision "
        r"publishes no weights for name='resnet10'",
    ):
        build_model(cfg, datamodule)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.backbone.name=resnet7", r"^model.backbone.name='resnet7' is unknown"),
        ("model.backbone.trainable_layers=6", r"^model.backbone.trainable_layers=6 must be in \[0, 5\]"),
        (
            "model.rpn.anchor_sizes=[16,32]",
            r"^model.rpn.anchor_sizes=\[16, 32\] has 2 entries but the FPN has 5 levels",
        ),
        ("+model.rpn.nms_threshold=0.5", r"^model.rpn.nms_threshold=0.5 is not a known RPN setting"),
        ("+model.roi_heads.box_width=5", r"^model.roi_heads.box_width=5 is not a known RoI-head setting"),
    ],
)
def test_bad_model_settings_name_the_field(override: str, message: str, tmp_path: Path) -> None:
    """The builders name their argument (``backbone.name``); the command line adds the config node
    (``model.``).
    """
    cfg = compose_config([override], tmp_path)
    with pytest.raises(ArgumentError, match=message):
        build_model(cfg, SimpleNamespace(num_classes=3))


def test_the_precision_config_and_the_python_defaults_agree(tmp_path: Path) -> None:
    """``conf/precision/default.yaml`` holds the same defaults as the plugin's own (one home each in Python:
    the guard's in ``precision.guard``, GradScaler's in ``precision.options``), so a plugin built without the
    config (a research script) behaves as ``fit`` does.
    """
    import dataclasses
    import inspect

    from lit_amp_det.precision import HalfPrecisionOptions, build_precision_plugin

    composed = dict(compose_config([], tmp_path).precision)
    options = {f.name: f.default for f in dataclasses.fields(HalfPrecisionOptions)}
    keywords = {
        name: parameter.default
        for name, parameter in inspect.signature(build_precision_plugin).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert composed == keywords
    assert {key: composed[key] for key in options} == options

"""Every config group composes and instantiates; bad values fail early with the field named."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.error import URLError

import lightning.pytorch as pl
import pytest
import torch
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from conftest import CONFIG_ERRORS, compose_config
from lit_amp_det import MaskRCNNModule
from lit_amp_det.app import tasks
from lit_amp_det.app.config import RENAMED_SETTINGS, check_config, config_groups
from lit_amp_det.app.overrides import UnknownSetting, prepare_overrides
from lit_amp_det.app.tasks import build_model, build_trainer
from lit_amp_det.data import ShapesDataModule
from lit_amp_det.errors import ArgumentError
from lit_amp_det.models.speedups import DEFAULT_SPEEDUPS
from lit_amp_det.module_settings import EvaluationSettings, OptimSettings
from lit_amp_det.precision import HalfPrecisionOptions, build_precision_plugin
from lit_amp_det.settings import (
    BackboneSettings,
    DetectorSettings,
    PrecisionSettings,
    RoIHeadsSettings,
    RPNSettings,
    TransformSettings,
)

GROUPS = config_groups()
#: The model's typed nested settings, by their key under ``model``.
SCHEMAS = {
    "backbone": BackboneSettings,
    "transform": TransformSettings,
    "rpn": RPNSettings,
    "roi_heads": RoIHeadsSettings,
}


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
        match=r"^data\.image_size, data\.test_size, data\.train_size, data\.val_size: .*CocoDataModule",
    ):
        check_config(compose_config(["experiment=smoke", "data=coco"], tmp_path))
    check_config(compose_config(["data=coco"], tmp_path))  # the option's own keys pass
    check_config(compose_config(["experiment=smoke"], tmp_path))


def test_bad_precision_names_the_field(tmp_path: Path) -> None:
    """One check (``precision.build.check_precision``): the plugin builder runs it, and the command runs it
    first, before the data or the model is built.
    """
    with pytest.raises(CONFIG_ERRORS, match=r"trainer\.precision='16'"):
        check_config(compose_config(["trainer.precision=16"], tmp_path))
    with pytest.raises(ValueError, match=r"trainer\.precision='16'"):
        build_precision_plugin("16")


def test_a_bad_precision_stops_the_command_before_anything_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def built(*args: object, **kwargs: object) -> None:
        raise AssertionError("built before trainer.precision was checked")

    monkeypatch.setattr(tasks, "build_datamodule", built)
    monkeypatch.setattr(tasks, "build_model", built)
    with pytest.raises(ValueError, match=r"trainer\.precision='fp16'"):
        tasks.train(compose_config(["experiment=smoke", "trainer.precision=fp16"], tmp_path))


def test_weights_for_another_architecture_name_the_mismatch(tmp_path: Path) -> None:
    datamodule = SimpleNamespace(num_classes=3)
    cfg = compose_config(["model.weights=COCO_V1"], tmp_path)  # maskrcnn_light: R18, 64-wide FPN, slim heads
    with pytest.raises(
        ArgumentError,
        match=r"^model\.weights='COCO_V1' .*backbone\.name=resnet18 \(needs resnet50\)",
    ):
        build_model(cfg, datamodule)
    cfg = compose_config(["model=maskrcnn_tiny", "model.backbone.weights=IMAGENET1K_V1"], tmp_path)
    with pytest.raises(
        ArgumentError,
        match=r"^model\.backbone\.weights='IMAGENET1K_V1' .*name='resnet10'",
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
    """``conf/precision/default.yaml`` holds the same defaults as the plugin's own (one home in Python:
    ``settings.PrecisionSettings``, which the guard's and GradScaler's constants read), so a plugin built
    without the config (a research script) behaves as ``fit`` does.
    """
    composed = OmegaConf.to_container(compose_config([], tmp_path).precision)
    options = {f.name: f.default for f in dataclasses.fields(HalfPrecisionOptions)}
    keywords = {
        name: parameter.default
        for name, parameter in inspect.signature(build_precision_plugin).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert composed == dataclasses.asdict(PrecisionSettings()) == keywords
    assert {key: composed[key] for key in options} == options


def _listed(node: DictConfig) -> dict[str, Any]:
    """What a composed node lists, as plain data."""
    return OmegaConf.to_container(node, resolve=True)


def test_the_default_config_lists_the_python_defaults(tmp_path: Path) -> None:
    """Each default has one home in Python (``lit_amp_det.settings``, ``models.speedups.DEFAULT_SPEEDUPS``);
    the default config lists the same values, so ``MaskRCNNModule(num_classes)`` in a script is the model that
    ``fit`` trains.
    """
    cfg = compose_config([], tmp_path)
    detector = DetectorSettings()
    for name in ("backbone", "transform", "rpn", "roi_heads"):
        assert _listed(cfg.model[name]) == dataclasses.asdict(getattr(detector, name)), name
    assert _listed(cfg.optim) == dataclasses.asdict(OptimSettings())
    assert _listed(cfg.model.evaluation) == dataclasses.asdict(EvaluationSettings())
    assert {
        name: node for name, node in _listed(cfg.speedups).items() if node is not None
    } == DEFAULT_SPEEDUPS
    configured = instantiate(cfg.model, _convert_="all", num_classes=3)
    assert configured.detector_settings == MaskRCNNModule(3).detector_settings == detector


@pytest.mark.parametrize("option", GROUPS["model"])
def test_every_model_option_is_typed(option: str, tmp_path: Path) -> None:
    """Every model option starts from the typed schemas, and what it sets is what the module reads."""
    model = compose_config([f"model={option}"], tmp_path).model
    for name, kind in SCHEMAS.items():
        assert OmegaConf.get_type(model[name]) is kind, (option, name)
    settings = DetectorSettings.of(**{name: model[name] for name in SCHEMAS})
    assert settings.build_kwargs() == {name: _listed(model[name]) for name in SCHEMAS}


@pytest.mark.parametrize(
    ("group", "kind"),
    [("precision", PrecisionSettings), ("optim", OptimSettings)],
)
def test_every_option_of_the_runtime_groups_is_typed(group: str, kind: type, tmp_path: Path) -> None:
    for option in GROUPS[group]:
        assert OmegaConf.get_type(compose_config([f"{group}={option}"], tmp_path)[group]) is kind, option


@pytest.mark.parametrize(
    "override",
    [
        "model.rpn.nms_thresh=high",
        "model.backbone.fpn_channels=1.5",
        "model.roi_heads.mask_head_layers=[a]",
        "precision.init_scale=big",
        "precision.growth_interval=often",
        "optim.reference_batch=many",
        "optim.optimizer=adam",
    ],
)
def test_the_schemas_refuse_a_wrong_type_at_composition(override: str, tmp_path: Path) -> None:
    key = override.split("=", 1)[0]
    with pytest.raises(ConfigCompositionException, match=re.escape(override)) as caught:
        compose_config([override], tmp_path)
    assert str(getattr(caught.value.__cause__, "full_key", "")).startswith(key)


@pytest.mark.parametrize(
    ("override", "close"),
    [
        ("model.rpn.nms_threshold=0.5", "model.rpn.nms_thresh"),
        ("model.roi_heads.detections_per_image=5", "model.roi_heads.detections_per_img"),
        ("precision.init_scal=8", "precision.init_scale"),
    ],
)
def test_a_key_the_schema_lacks_names_the_closest_setting(override: str, close: str) -> None:
    key = override.split("=", 1)[0]
    with pytest.raises(UnknownSetting, match=rf"{re.escape(key)} .*{re.escape(close)}"):
        prepare_overrides([override])


def test_the_module_takes_typed_settings_and_keeps_plain_hyperparameters() -> None:
    backbone = BackboneSettings(name="resnet10", fpn_channels=32)
    module = MaskRCNNModule(3, backbone=backbone, rpn={"nms_thresh": 0.6}, speedups={})
    assert module.detector_settings.backbone == backbone
    assert module.detector_settings.rpn == RPNSettings(nms_thresh=0.6)  # the other keys: the defaults
    assert module.hparams.backbone == dataclasses.asdict(backbone)  # plain data in every checkpoint
    assert module.hparams.rpn == {"nms_thresh": 0.6}
    assert module.model.rpn.nms_thresh == 0.6
    assert module.model.backbone.fpn.inner_blocks[0][0].out_channels == 32
    with pytest.raises(ArgumentError, match=r"^rpn\.nms_threshold=0\.6"):
        MaskRCNNModule(3, rpn={"nms_threshold": 0.6})


@pytest.mark.parametrize(("old", "new"), list(RENAMED_SETTINGS.items()))
def test_an_old_setting_name_is_refused_naming_the_new_one(old: str, new: str, tmp_path: Path) -> None:
    for multirun in (False, True):
        with pytest.raises(UnknownSetting, match=rf"{re.escape(old)} .*{re.escape(new)}"):
            prepare_overrides([f"{old}=3"], multirun)
        with pytest.raises(UnknownSetting, match=rf"{re.escape(old)} .*{re.escape(new)}"):
            prepare_overrides([f"+{old}=3"], multirun)
    written_for_the_old_name = compose_config([f"+{old}=3"], tmp_path)  # an experiment file of the user's
    with pytest.raises(ValueError, match=rf"{re.escape(old)} .*{re.escape(new)}"):
        check_config(written_for_the_old_name)


def test_the_data_seeds_reach_the_data_module(tmp_path: Path) -> None:
    shapes = instantiate(compose_config([], tmp_path).data)
    assert (shapes.sampler_seed, shapes.spec.seed) == (0, 0)  # seed: 0 and the generator's default
    cfg = compose_config(["seed=4", "data.generation_seed=7"], tmp_path)
    shapes = instantiate(cfg.data)
    assert (shapes.sampler_seed, shapes.spec.seed) == (4, 7)  # the sampler follows the global seed
    cfg = compose_config(["seed=4", "data.sampler_seed=5"], tmp_path)
    assert instantiate(cfg.data).sampler_seed == 5
    coco = instantiate(
        compose_config(["data=coco", f"data.root={tmp_path}", "data.sampler_seed=6"], tmp_path).data
    )
    assert coco.sampler_seed == 6


@pytest.mark.parametrize(("old", "new"), [("seed", "sampler_seed"), ("data_seed", "generation_seed")])
def test_the_data_module_refuses_an_old_argument_naming_the_new_one(
    old: str, new: str, tmp_path: Path
) -> None:
    with pytest.raises(ArgumentError, match=rf"^{old}=3 .*{new}"):
        ShapesDataModule(tmp_path, **{old: 3})

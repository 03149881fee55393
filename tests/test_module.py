"""MaskRCNNModule: steps, fp32 predictions, override points, weight loading, settings and speedups."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn
from torchvision.models.detection.roi_heads import RoIHeads
from torchvision.models.detection.rpn import RegionProposalNetwork
from torchvision.models.detection.transform import GeneralizedRCNNTransform

from conftest import CONFIG_ERRORS, compose_config
from lit_amp_det import MaskRCNNModule
from lit_amp_det.errors import ArgumentError
from lit_amp_det.models.ext_ops import ExtRegionProposalNetwork, ExtRoIHeads
from lit_amp_det.models.mask_paste import BinaryMaskTransform
from lit_amp_det.models.maskrcnn import build_detector
from lit_amp_det.models.speedups import ModelTransform
from ops_inputs import needs_cuda


def _tiny(tmp_path: Path, *overrides: str, configure: bool = True) -> MaskRCNNModule:
    """The smoke model with 3 classes, speedups applied as a Trainer applies them (``configure_model``)."""
    cfg = compose_config(["experiment=smoke", *overrides], tmp_path)
    module = instantiate(cfg.model, num_classes=4, category_ids=[10, 20, 30])
    if configure:
        module.configure_model()
    return module


def _smoke_module(tmp_path: Path, **settings: object) -> MaskRCNNModule:
    """The smoke model built in Python (not configured): ``settings`` replace its config's arguments."""
    cfg = OmegaConf.to_container(compose_config(["experiment=smoke"], tmp_path).model, resolve=True)
    kwargs = {k: v for k, v in cfg.items() if not k.startswith("_") and k != "num_classes"}
    return MaskRCNNModule(4, **{**kwargs, **settings})


def _batch(n: int = 2, size: int = 64) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=gen) for _ in range(n)]
    targets = []
    for i in range(n):
        masks = torch.zeros(2, size, size, dtype=torch.uint8)
        masks[0, 5:30, 8:40] = 1
        masks[1, 30:60, 20:50] = 1
        targets.append(
            {
                "boxes": torch.tensor([[8.0, 5.0, 40.0, 30.0], [20.0, 30.0, 50.0, 60.0]]),
                "labels": torch.tensor([1, 3]),
                "masks": masks,
                "iscrowd": torch.tensor([0, 1]),
                "area": torch.tensor([800.0, 900.0]),
                "image_id": torch.tensor(i + 1),
            }
        )
    return images, targets


def test_training_loss_is_finite_and_crowd_is_ignored(tmp_path: Path) -> None:
    module = _tiny(tmp_path)
    images, targets = _batch()
    seen = []
    module.model.roi_heads.register_forward_pre_hook(lambda m, args: seen.append(args[3]))
    module.train()
    loss = module.compute_loss(module.model(module.prepare_images(images), module.training_targets(targets)))
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert [len(t["boxes"]) for t in seen[0]] == [1, 1]  # the crowd instance never reaches the heads
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())


class _RecordedStep:
    """A CapturedStep that records what it is handed and returns fixed losses (the model is not run)."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, object, object]] = []

    def run(self, module, images, targets):
        self.calls.append((module, images, targets))
        return {"loss_mask": torch.tensor(0.25)}, torch.tensor(1.5)


def test_an_installed_captured_step_trains_every_batch_until_removed(tmp_path: Path, monkeypatch) -> None:
    """set_captured_step: training_step hands the batch over as the loader delivered it, the module optimises
    manually meanwhile, and automatically again once the step is removed.
    """
    module = _tiny(tmp_path)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    monkeypatch.setattr(module, "optimizers", lambda: optimizer)
    step = _RecordedStep()
    module.set_captured_step(step)
    assert module.captured_step is step and not module.automatic_optimization
    images, targets = _batch()
    loss = module.training_step((images, targets), 0)
    assert float(loss) == 1.5 and len(step.calls) == 1
    handed = step.calls[0]
    assert handed[0] is module and handed[1] is images and handed[2] is targets
    module.set_captured_step(None)
    assert module.captured_step is None and module.automatic_optimization
    with pytest.raises(AttributeError):
        module.captured_step = step  # installed only through set_captured_step


@pytest.mark.parametrize("speedups", ["default", "none"])
def test_predictions_are_fp32_with_boolean_masks(tmp_path: Path, speedups: str) -> None:
    module = _tiny(tmp_path, "model.roi_heads.score_thresh=0.0", f"speedups={speedups}").eval()
    # the boolean paste (a default speedup) or torchvision's probabilities thresholded by postprocess
    assert isinstance(module.model.transform, BinaryMaskTransform) == (speedups == "default")
    images, targets = _batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = module.predict_step((images, targets), 0)
    assert len(outputs) == 2 and outputs[0]["image_id"] == 1
    for out in outputs:
        assert out["boxes"].dtype == torch.float32 and out["scores"].dtype == torch.float32
        assert out["masks"].dtype == torch.bool and out["masks"].shape[1:] == (64, 64)
        assert set(out["category_ids"].tolist()) <= {10, 20, 30}
    assert sum(len(o["boxes"]) for o in outputs) > 0


def test_predict_batches_reuse_one_category_lookup_on_the_device(tmp_path: Path) -> None:
    """The category ids travel to the device once, not with every predict batch; new ids make a new lookup."""
    module = _tiny(tmp_path, "model.roi_heads.score_thresh=0.0").eval()
    images, targets = _batch()
    with torch.inference_mode():
        module.predict_step((images, targets), 0)
        first = module._category_lookup()
        outputs = module.predict_step((images, targets), 1)
        assert module._category_lookup() is first and first.tolist() == [10, 20, 30]
    labels = torch.cat([o["labels"] for o in outputs])
    assert labels.numel() > 0
    assert torch.equal(
        torch.cat([o["category_ids"] for o in outputs]), torch.tensor([10, 20, 30])[labels - 1]
    )
    module.hparams.category_ids = [7, 8, 9]
    assert module._category_lookup().tolist() == [7, 8, 9]


def test_validation_computes_coco_map(tmp_path: Path) -> None:
    module = _tiny(tmp_path).eval()
    images, targets = _batch()
    logged = {}
    module.log_dict = lambda values, **kw: logged.update(values)  # capture without a Trainer
    module._trainer = SimpleNamespace(sanity_checking=False, global_step=5)
    with torch.no_grad():
        module.validation_step((images, targets), 0)
    module.on_validation_epoch_end()
    assert module.last_validated_step == 5
    for key in ("val/bbox_mAP", "val/bbox_mAP_50", "val/segm_mAP", "val/segm_mAP_50"):
        assert key in logged and 0.0 <= float(logged[key]) <= 1.0


def test_faster_rcnn_switch(tmp_path: Path) -> None:
    module = _tiny(tmp_path, "model.mask=false").eval()
    assert module.model.roi_heads.mask_head is None
    with torch.no_grad():
        out = module(_batch()[0])
    assert "masks" not in out[0]


class _HalfMaskLoss(MaskRCNNModule):
    def compute_loss(self, loss_dict):
        self.seen_keys = sorted(loss_dict)
        return sum(v * (0.5 if k == "loss_mask" else 1.0) for k, v in loss_dict.items())


def test_subclass_override_points_are_used(tmp_path: Path) -> None:
    cfg = compose_config(["experiment=smoke", f"model._target_={__name__}._HalfMaskLoss"], tmp_path)
    module = instantiate(cfg.model, num_classes=4)
    assert type(module) is _HalfMaskLoss
    module.log = module.log_dict = lambda *a, **k: None
    module.optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.1)
    module.train()
    module.training_step(_batch(), 0)
    assert module.seen_keys == [
        "loss_box_reg",
        "loss_classifier",
        "loss_mask",
        "loss_objectness",
        "loss_rpn_box_reg",
    ]


def test_weights_load_from_state_dict_and_lightning_checkpoint(tmp_path: Path) -> None:
    source = _tiny(tmp_path)
    raw = tmp_path / "model.pt"
    torch.save(source.model.state_dict(), raw)
    lightning_ckpt = tmp_path / "module.ckpt"
    torch.save({"state_dict": source.state_dict(), "hyper_parameters": dict(source.hparams)}, lightning_ckpt)
    for path in (raw, lightning_ckpt):
        loaded = _tiny(tmp_path, f"model.weights={path}")
        for key, value in source.model.state_dict().items():
            assert torch.equal(value, loaded.model.state_dict()[key]), key


def test_another_class_count_fine_tunes_without_a_switch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = _tiny(tmp_path)
    path = tmp_path / "model.pt"
    torch.save(source.model.state_dict(), path)
    cfg = compose_config(["experiment=smoke", f"model.weights={path}"], tmp_path)
    with caplog.at_level(logging.WARNING, logger="lit_amp_det.checkpoints"):
        module = instantiate(cfg.model, num_classes=6)
    saved, loaded = source.model.state_dict(), module.model.state_dict()
    class_layers = sorted(k for k in loaded if loaded[k].shape != saved[k].shape)
    assert class_layers == [
        "roi_heads.box_predictor.bbox_pred.bias",
        "roi_heads.box_predictor.bbox_pred.weight",
        "roi_heads.box_predictor.cls_score.bias",
        "roi_heads.box_predictor.cls_score.weight",
        "roi_heads.mask_predictor.mask_fcn_logits.bias",
        "roi_heads.mask_predictor.mask_fcn_logits.weight",
    ]
    for key, value in loaded.items():  # everything else comes from the file
        if key not in class_layers:
            assert torch.equal(value, saved[key]), key
    assert (
        "made for another class count; 6 class-dependent predictor tensors keep their fresh initialisation"
        in caplog.text
    )


def test_unsafe_or_missing_checkpoints_are_refused(tmp_path: Path) -> None:
    pickled = tmp_path / "code.pt"
    torch.save({"state_dict": {"x": torch.zeros(1)}, "fn": _HalfMaskLoss}, pickled)
    with pytest.raises(CONFIG_ERRORS, match=r"weights_only=True"):
        _tiny(tmp_path, f"model.weights={pickled}")
    with pytest.raises(CONFIG_ERRORS, match=r"nope\.pt"):
        _tiny(tmp_path, f"model.weights={tmp_path / 'nope.pt'}")


# ------------------------------------------------------------------------------------------ constructor
# settings
def test_the_constructor_takes_at_most_twelve_arguments() -> None:
    params = [p for p in inspect.signature(MaskRCNNModule.__init__).parameters.values() if p.name != "self"]
    assert len(params) <= 12, [p.name for p in params]
    assert [p.name for p in params] == [
        "num_classes",
        "class_names",
        "category_ids",
        "mask",
        "backbone",
        "transform",
        "rpn",
        "roi_heads",
        "weights",
        "optim",
        "evaluation",
        "speedups",
    ]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[1:])


_CHANNELS_LAST = "lit_amp_det.models.speedups.ChannelsLast"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"optim": {"optimizer": {"lr": 0.1}}}, r"^optim\.optimizer=\{'lr': 0\.1\}.*_target_"),
        (
            {"optim": {"optimizer": {"_target_": None}}},
            r"^optim\.optimizer=\{'_target_': None\}",
        ),
        (
            {"optim": {"scheduler": {"warmup_steps": 3}}},
            r"^optim\.scheduler=\{'warmup_steps': 3\}.*_target_",
        ),
        ({"optim": {"reference_batch": 0}}, r"^optim\.reference_batch=0\b"),
        (
            {"optim": {"optimiser": {"_target_": "torch.optim.SGD"}}},
            r"^optim=.*\['optimiser'\]",
        ),
        (
            {"evaluation": {"mask_threshold": 1.0}},
            r"^evaluation\.mask_threshold=1\.0\b",
        ),
        ({"evaluation": {"mask_threshold": True}}, r"^evaluation\.mask_threshold=True\b"),
        (
            {"evaluation": {"threshold": 0.5}},
            r"^evaluation=\{'threshold': 0\.5\}.*\['threshold'\]",
        ),
        ({"evaluation": {"backend": "cocoapi"}}, r"^evaluation\.backend='cocoapi'"),
        (
            {"speedups": {"channels_last": {"_target_": _CHANNELS_LAST, "devices": ["tpu"]}}},
            r"^speedups\.channels_last\.devices=\['tpu'\].*\['cpu', 'cuda'\]",
        ),
        ({"speedups": {"ext_ops": True}}, r"^speedups\.ext_ops=True.*_target_"),
        (
            {"speedups": {"mine": {"_target_": "torch.nn.Identity"}}},
            r"^speedups\.mine\._target_='torch\.nn\.Identity' made a Identity, not a "
            r"lit_amp_det\.models\.speedups",
        ),
    ],
)
def test_settings_errors_name_the_setting_before_any_work(
    monkeypatch: pytest.MonkeyPatch, settings: dict, message: str
) -> None:
    def build_model(self: MaskRCNNModule) -> nn.Module:
        raise AssertionError("the model was built before the settings were checked")

    monkeypatch.setattr(MaskRCNNModule, "build_model", build_model)
    with pytest.raises(ArgumentError, match=message):
        MaskRCNNModule(4, **settings)


def test_settings_missing_keys_take_the_defaults(tmp_path: Path) -> None:
    module = _smoke_module(tmp_path, optim={"reference_batch": 8}, evaluation={"backend": "pycocotools"})
    assert module.optim_settings.optimizer["_target_"] == "torch.optim.AdamW"
    assert module.optim_settings.scheduler["_target_"] == "lit_amp_det.optim.warmup_schedule"
    assert module.optim_settings.reference_batch == 8
    assert (module.evaluation_settings.mask_threshold, module.evaluation_settings.backend) == (
        0.5,
        "pycocotools",
    )
    assert module.hparams.optim == {"reference_batch": 8}  # saved as given: plain data


# ------------------------------------------------------------------------------------------------- speedups
_TORCHVISION = {"rpn": RegionProposalNetwork, "roi_heads": RoIHeads, "transform": GeneralizedRCNNTransform}
_SPEEDED = {"rpn": ExtRegionProposalNetwork, "roi_heads": ExtRoIHeads, "transform": BinaryMaskTransform}


def _parts(model: nn.Module) -> dict[str, type]:
    return {name: type(getattr(model, name)) for name in _TORCHVISION}


class _OwnModel(MaskRCNNModule):
    """Builds its own detector (here torchvision's, as the package builds it)."""

    def build_model(self) -> nn.Module:
        hp = self.hparams
        return build_detector(
            hp.num_classes,
            mask=hp.mask,
            backbone=hp.backbone,
            transform=hp.transform,
            rpn=hp.rpn,
            roi_heads=hp.roi_heads,
        )


class _OwnModelWithSpeedups(_OwnModel):
    def model_transforms(self) -> list[ModelTransform]:
        return self.configured_speedups


@pytest.mark.parametrize(
    ("cls", "expected", "applied"),
    [
        (_OwnModel, _TORCHVISION, []),
        (_OwnModelWithSpeedups, _SPEEDED, ["ext_ops", "binary_mask_paste"]),
    ],
)
def test_a_subclass_that_builds_its_model_opts_in_to_speedups(
    tmp_path: Path, cls: type, expected: dict, applied: list[str]
) -> None:
    cfg = compose_config(
        ["experiment=smoke", f"model._target_={__name__}.{cls.__name__}", "model.roi_heads.score_thresh=0.0"],
        tmp_path,
    )
    module = instantiate(cfg.model, num_classes=4)
    built = module.model
    assert module.applied_speedups is None  # nothing applied before configure_model
    module.configure_model()
    assert module.model is built
    assert _parts(module.model) == expected
    assert module.applied_speedups == applied
    with torch.no_grad():
        out = module.eval()(_batch()[0])
    assert sum(len(o["boxes"]) for o in out) > 0 and all(o["masks"].dtype == torch.bool for o in out)


class _Counting(ModelTransform):
    """Counts its applications."""

    name = "counting"
    calls: ClassVar[list[nn.Module]] = []

    def __call__(self, model: nn.Module) -> nn.Module:
        type(self).calls.append(model)
        return model


def test_configure_model_applies_the_speedups_once(tmp_path: Path) -> None:
    _Counting.calls.clear()
    cfg = compose_config(
        ["experiment=smoke", f"+speedups.counting={{_target_:{__name__}._Counting}}"], tmp_path
    )
    module = instantiate(cfg.model, num_classes=4)
    assert _parts(module.model) == _TORCHVISION and not _Counting.calls  # built as torchvision builds it
    module.configure_model()
    model = module.model
    assert _Counting.calls == [model] and _parts(model) == _SPEEDED
    module.configure_model()  # Lightning calls it again for every fit/validate/test/predict
    assert _Counting.calls == [model] and module.model is model
    assert module.applied_speedups == ["ext_ops", "binary_mask_paste", "counting"]


@pytest.mark.parametrize(
    ("speedups", "override", "expected", "applied"),
    [
        ({}, [], _TORCHVISION, []),
        (None, ["speedups=none"], _TORCHVISION, []),
        (None, [], _SPEEDED, ["ext_ops", "binary_mask_paste"]),  # conf/speedups/default.yaml
        ("python default", [], _SPEEDED, ["ext_ops", "binary_mask_paste"]),  # speedups=None in Python
        (
            None,
            ["speedups.ext_ops=null"],
            {**_TORCHVISION, "transform": BinaryMaskTransform},
            ["binary_mask_paste"],
        ),
        (
            None,
            ["speedups.binary_mask_paste=null"],
            {**_SPEEDED, "transform": GeneralizedRCNNTransform},
            ["ext_ops"],
        ),
    ],
)
def test_speedups_choose_the_implementation(
    tmp_path: Path, speedups: object, override: list[str], expected: dict, applied: list[str]
) -> None:
    if speedups is None:
        module = instantiate(compose_config(["experiment=smoke", *override], tmp_path).model, num_classes=4)
    else:
        module = _smoke_module(tmp_path, speedups=None if speedups == "python default" else speedups)
    module.configure_model()
    assert _parts(module.model) == expected
    assert module.applied_speedups == applied


@pytest.mark.parametrize(("devices", "applied"), [(["cuda"], False), (["cpu"], True), (None, True)])
def test_a_speedup_applies_only_on_its_devices(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, devices: list[str] | None, applied: bool
) -> None:
    entry = {"_target_": _CHANNELS_LAST, **({} if devices is None else {"devices": devices})}
    module = _smoke_module(tmp_path, speedups={"channels_last": entry})
    assert module.device.type == "cpu"
    with caplog.at_level(logging.INFO, logger="lit_amp_det.models.speedups"):
        module.configure_model()
    assert module.applied_speedups == (["channels_last"] if applied else [])
    weight = module.model.backbone.body.layer1[0].conv1.weight
    assert weight.is_contiguous(memory_format=torch.channels_last) == applied
    assert ("speedups.channels_last is for cuda: not applied on cpu" in caplog.text) == (not applied)


_ON_DEVICE = {
    "cpu": ["ext_ops", "binary_mask_paste"],
    "gpu": ["ext_ops", "binary_mask_paste", "sync_free", "channels_last", "compile"],
}  # conf/speedups/gpu.yaml


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=needs_cuda)])
def test_a_trainer_applies_the_speedups_of_its_device(tmp_path: Path, accelerator: str) -> None:
    """Lightning calls ``configure_model`` before it moves the module: the Trainer's device decides, not the
    module's (still on the CPU then).
    """
    from lightning.pytorch import Trainer

    module = _tiny(tmp_path, "speedups=gpu", "model.roi_heads.score_thresh=0.0", configure=False)
    batches = torch.utils.data.DataLoader([_batch()], batch_size=None)
    trainer = Trainer(
        accelerator=accelerator,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    predictions = [p for batch in trainer.predict(module, dataloaders=batches) for p in batch]
    assert module.applied_speedups == _ON_DEVICE[accelerator]
    weight = module.model.backbone.body.layer1[0].conv1.weight
    assert weight.is_contiguous(memory_format=torch.channels_last) == (accelerator == "gpu")
    assert len(predictions) == 2 and sum(len(p["boxes"]) for p in predictions) > 0
    assert all(p["masks"].dtype == torch.bool for p in predictions)

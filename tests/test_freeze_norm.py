"""FreezeNorm and the dtype-keeping FrozenBatchNorm2d: frozen statistics and stages, checkpoints, errors."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torchvision
from hydra.utils import instantiate
from lightning.pytorch import Callback
from torch import nn
from torch.utils.data import DataLoader
from torchvision.models._utils import IntermediateLayerGetter

from conftest import CONFIG_ERRORS, SMOKE, compose_config
from lit_amp_det import MaskRCNNModule
from lit_amp_det.app.tasks import build_trainer
from lit_amp_det.callbacks.freeze_norm import FreezeNorm
from lit_amp_det.data.transforms import collate_detection
from lit_amp_det.errors import ArgumentError
from lit_amp_det.models.maskrcnn import BACKBONES, build_backbone
from lit_amp_det.models.norms import FrozenBatchNorm2d, convert_frozen_batchnorm

BODY = "model.backbone.body."
STEPS = 3


# ----------------------------------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """The model is tiny: intra-op threads cost more than they give (on a busy 2-core machine, 50x more)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _module(tmp_path: Path, *overrides: str, seed: int = 0) -> MaskRCNNModule:
    """The smoke model (resnet10, 32-channel FPN, 64-px images) with a constant lr, so every step moves
    weights.
    """
    torch.manual_seed(seed)
    cfg = compose_config(
        [*SMOKE, "optim.scheduler.policy=constant", "optim.scheduler.warmup_steps=0", *overrides], tmp_path
    )
    return instantiate(cfg.model, num_classes=4)


def _loader(batches: int = STEPS) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(2 * batches):
        masks = torch.zeros(1, 64, 64, dtype=torch.uint8)
        masks[0, 10:40, 12:50] = 1
        target = {
            "boxes": torch.tensor([[12.0, 10.0, 50.0, 40.0]]),
            "labels": torch.tensor([1 + i % 3]),
            "masks": masks,
            "image_id": torch.tensor(i + 1),
        }
        samples.append((torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=gen), target))
    return DataLoader(samples, batch_size=2, collate_fn=collate_detection)


def _trainer(*callbacks: Callback, steps: int = STEPS) -> pl.Trainer:
    return pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        callbacks=list(callbacks),
    )


class _CallsTrain(Callback):
    """Calls ``train()`` after every batch, as the default ``on_validation_model_train`` hook,
    ``BaseFinetuning.make_trainable`` or user code do in the middle of an epoch.
    """

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.train()


class _Recorder(Callback):
    """Which parameters had gradients at some backward, the optimizer's parameters, and module modes."""

    def __init__(self) -> None:
        self.with_grad: set[str] = set()
        self.optimized: set[int] = set()
        self.bn_training: list[bool] = []  # BatchNorm2d.training at each forward
        self.stage_training: dict[str, set[bool]] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.optimized = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
        for module in pl_module.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.register_forward_pre_hook(lambda m, args: self.bn_training.append(m.training))

    def on_after_backward(self, trainer, pl_module) -> None:
        self.with_grad |= {name for name, p in pl_module.named_parameters() if p.grad is not None}
        for stage in ("conv1", "bn1", "layer1", "layer2", "layer3", "layer4"):
            module = getattr(pl_module.model.backbone.body, stage)
            self.stage_training.setdefault(stage, set()).add(module.training)


def _fit(module: MaskRCNNModule, *callbacks: Callback) -> _Recorder:
    recorder = _Recorder()
    trainer = _trainer(recorder, _CallsTrain(), *callbacks)
    trainer.fit(module, train_dataloaders=_loader())
    assert trainer.global_step == STEPS
    return recorder


def _statistics(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.clone() for k, v in module.state_dict().items() if k.endswith(("running_mean", "running_var"))
    }


def _batchnorm_count(module: nn.Module) -> int:
    return sum(isinstance(m, nn.BatchNorm2d) for m in module.modules())


def _randomise_statistics(module: nn.Module, seed: int) -> None:
    """Gives every norm statistics unlike a fresh model's, as a pretrained trunk has."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)


def _random_bn(channels: int = 8, seed: int = 0) -> nn.BatchNorm2d:
    gen = torch.Generator().manual_seed(seed)
    bn = nn.BatchNorm2d(channels)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(channels, generator=gen) + 0.5)
        bn.bias.copy_(torch.randn(channels, generator=gen))
        bn.running_mean.copy_(torch.randn(channels, generator=gen))
        bn.running_var.copy_(torch.rand(channels, generator=gen) * 2 + 0.5)
    return bn.eval()


def _names(module: nn.Module, *prefixes: str) -> set[str]:
    return {
        name for name, _ in module.named_parameters() if name.startswith(tuple(BODY + p for p in prefixes))
    }


def _batchnorm_affine(module: nn.Module) -> set[str]:
    norms = [name for name, m in module.named_modules() if isinstance(m, nn.BatchNorm2d)]
    return {f"{name}.{p}" for name in norms for p in ("weight", "bias")}


def _check_frozen_and_trained(
    module: nn.Module,
    before: dict[str, torch.Tensor],
    recorder: _Recorder,
    frozen: set[str],
    trained: set[str],
) -> None:
    assert frozen and trained and not frozen & trained
    params = dict(module.named_parameters())
    for name in frozen:
        assert not params[name].requires_grad and name not in recorder.with_grad, name
        assert torch.equal(params[name], before[name]), name
        assert id(params[name]) not in recorder.optimized, name
    for name in trained:
        assert name in recorder.with_grad, name
        assert not torch.equal(params[name], before[name]), name


# ------------------------------------------------------------------------------------ running statistics
@pytest.mark.parametrize("mode", [None, "norm_eval", "frozen_bn"])
def test_running_statistics_stay_fixed_only_with_the_callback(mode: str | None, tmp_path: Path) -> None:
    module = _module(tmp_path)
    count = _batchnorm_count(module)
    before = _statistics(module)
    before_params = {name: p.detach().clone() for name, p in module.named_parameters()}
    assert count > 0 and len(before) == 2 * count
    recorder = _fit(module, *([FreezeNorm(mode=mode)] if mode else []))
    after = _statistics(module)
    assert after.keys() == before.keys()  # frozen_bn keeps the statistics' names
    changed = {key for key in before if not torch.equal(before[key], after[key])}
    if mode is None:
        assert changed == set(before)  # without the callback every statistic moves: the test can fail
        assert recorder.bn_training and all(recorder.bn_training)
    else:
        assert changed == set()
    if mode == "norm_eval":
        # train() after every batch (_CallsTrain) did not leave BatchNorm in train mode for the next forward
        assert len(recorder.bn_training) == STEPS * count and not any(recorder.bn_training)
        assert _batchnorm_count(module) == count
        # affine_trainable=True: gamma and beta still train
        params = dict(module.named_parameters())
        affine = _batchnorm_affine(module)
        assert len(affine) == 2 * count and affine <= recorder.with_grad
        assert all(not torch.equal(params[name], before_params[name]) for name in affine)
    if mode == "frozen_bn":
        frozen = [m for m in module.modules() if isinstance(m, torchvision.ops.FrozenBatchNorm2d)]
        assert _batchnorm_count(module) == 0 and len(frozen) == count
        assert all(type(m) is FrozenBatchNorm2d for m in frozen)


# ------------------------------------------------------------------------ frozen stages and affine values
def test_frozen_stages_and_frozen_affine_with_norm_eval(tmp_path: Path) -> None:
    module = _module(tmp_path)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    recorder = _fit(
        module, FreezeNorm(mode="norm_eval", affine_trainable=False, frozen_stages=1)
    )  # FREEZE_AT=2
    affine = _batchnorm_affine(module)
    frozen = _names(module, "conv1.", "bn1.", "layer1.") | affine
    trained = _names(module, "layer2.", "layer3.", "layer4.") - affine
    assert BODY + "layer1.0.conv1.weight" in frozen and BODY + "layer4.0.bn2.weight" in frozen
    assert BODY + "layer2.0.conv1.weight" in trained and BODY + "layer4.0.conv2.weight" in trained
    _check_frozen_and_trained(module, before, recorder, frozen, trained)
    # frozen stages stay in eval mode although train() ran after every batch; later stages train
    assert recorder.stage_training["conv1"] == {False} and recorder.stage_training["layer1"] == {False}
    assert recorder.stage_training["layer2"] == {True} and recorder.stage_training["layer4"] == {True}


def test_frozen_stages_with_frozen_bn(tmp_path: Path) -> None:
    module = _module(tmp_path)
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    recorder = _fit(module, FreezeNorm(mode="frozen_bn", frozen_stages=2))
    assert not _batchnorm_affine(module)  # the former BatchNorm parameters are buffers now
    assert not any(".bn" in name or "downsample.1" in name for name, _ in module.named_parameters())
    # the swap happened before configure_optimizers: the optimizer holds no orphaned former-BatchNorm
    # parameter
    assert recorder.optimized == {id(p) for p in module.parameters() if p.requires_grad}
    _check_frozen_and_trained(
        module,
        before,
        recorder,
        _names(module, "conv1.", "layer1.", "layer2."),
        _names(module, "layer3.", "layer4."),
    )


@pytest.mark.parametrize(
    ("frozen_stages", "frozen"), [(0, ("conv1.", "layer1.")), (2, ("conv1.", "layer1.", "layer2."))]
)
def test_model_config_and_freeze_norm_together_freeze_the_union(
    tmp_path: Path, frozen_stages: int, frozen: tuple[str, ...]
) -> None:
    """Both homes can freeze: ``model.backbone.trainable_layers`` / ``norm`` build the model, FreezeNorm acts
    on it in setup() and only ever freezes more, so the stricter of the two wins for each stage.
    """
    module = _module(tmp_path, "model.backbone.trainable_layers=3", "model.backbone.norm=frozen_bn")
    assert not any(p.requires_grad for n, p in module.named_parameters() if n.startswith(BODY + "layer1."))
    _fit(
        module, FreezeNorm(mode="frozen_bn", frozen_stages=frozen_stages)
    )  # frozen_bn again: nothing to swap
    assert _names(module, *frozen) == {
        n for n, p in module.named_parameters() if n.startswith(BODY) and not p.requires_grad
    }


# ---------------------------------------------------------------------------------- FrozenBatchNorm2d
def test_frozen_batchnorm_matches_batchnorm_in_fp32() -> None:
    bn = _random_bn()
    frozen = convert_frozen_batchnorm(copy.deepcopy(bn))
    assert type(frozen) is FrozenBatchNorm2d and isinstance(frozen, torchvision.ops.FrozenBatchNorm2d)
    x = torch.randn(2, 8, 5, 7, generator=torch.Generator().manual_seed(1)) * 3 + 1
    out = frozen(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, bn(x))
    torch.testing.assert_close(frozen(x.to(memory_format=torch.channels_last)), bn(x))
    reference = (x.double() - bn.running_mean.double()[:, None, None]) / torch.sqrt(
        bn.running_var.double()[:, None, None] + bn.eps
    ) * bn.weight.double()[:, None, None] + bn.bias.double()[:, None, None]
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_frozen_batchnorm_keeps_the_input_dtype_under_autocast(dtype: torch.dtype, tol: float) -> None:
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(3, 8, 3), _random_bn()
    ours = FrozenBatchNorm2d.from_batchnorm(bn)
    theirs = torchvision.ops.FrozenBatchNorm2d(8)
    theirs.load_state_dict(bn.state_dict())
    x = torch.randn(2, 3, 9, 9)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        h = conv(x)
        out, promoted = ours(h), theirs(h)
    assert h.dtype == dtype  # the conv really ran in low precision
    assert out.dtype == dtype
    assert promoted.dtype == torch.float32  # torchvision's class promotes: what ours fixes
    with torch.no_grad():
        torch.testing.assert_close(out.float(), bn(h.float()), rtol=tol, atol=tol)


def test_a_converted_trunk_stays_in_bf16_under_autocast() -> None:
    """torchvision's FrozenBatchNorm2d promotes bf16 activations to fp32; ours keeps them (and is what
    ``model.backbone.norm=frozen_bn`` builds).
    """
    assert (
        build_backbone("resnet10", fpn_channels=32, norm="frozen_bn").body.bn1.__class__ is FrozenBatchNorm2d
    )
    trunk = torchvision.models.resnet.ResNet(
        torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], norm_layer=torchvision.ops.FrozenBatchNorm2d
    )
    trunk = nn.Sequential(
        *(
            getattr(trunk, name)
            for name in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4")
        )
    )
    count = sum(type(m) is torchvision.ops.FrozenBatchNorm2d for m in trunk.modules())
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = trunk(x)
        convert_frozen_batchnorm(trunk)
        after = trunk(x)
    assert before.dtype == torch.float32  # every block ends in an fp32 norm + add
    assert after.dtype == torch.bfloat16
    assert count == 12  # stem, two per block, three downsamples
    assert sum(type(m) is FrozenBatchNorm2d for m in trunk.modules()) == count


def test_convert_swaps_batchnorms_and_state_dicts_load_both_ways() -> None:
    tv_frozen = torchvision.ops.FrozenBatchNorm2d(8)
    tv_frozen.load_state_dict(_random_bn(seed=3).state_dict())
    net = nn.Sequential(
        nn.Conv2d(3, 8, 1),
        _random_bn(seed=1),
        nn.Sequential(nn.SyncBatchNorm(8).eval(), nn.BatchNorm2d(8, affine=False).eval()),
        tv_frozen,
    )
    with torch.no_grad():
        net[2][0].running_mean.fill_(0.5)
        net[2][1].running_var.fill_(4.0)
    original = copy.deepcopy(net)
    assert convert_frozen_batchnorm(net) is net  # children swapped in place
    assert [type(m) for m in (net[1], net[2][0], net[2][1], net[3])] == [FrozenBatchNorm2d] * 4
    x = torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # SyncBatchNorm in eval mode runs without a process group
        for converted, source in [
            (net[1], original[1]),
            (net[2][0], original[2][0]),
            (net[2][1], original[2][1]),
            (net[3], original[3]),
        ]:
            torch.testing.assert_close(converted(x), source(x))
    assert torch.equal(net[2][0].running_mean, torch.full((8,), 0.5))
    assert torch.equal(net[2][1].weight, torch.ones(8)) and torch.equal(net[2][1].bias, torch.zeros(8))

    # the keys are BatchNorm2d's without num_batches_tracked, and load strictly in both directions
    plain = nn.Sequential(nn.Conv2d(3, 8, 1), _random_bn(seed=1))
    frozen = convert_frozen_batchnorm(copy.deepcopy(plain))
    assert set(frozen.state_dict()) == set(plain.state_dict()) - {"1.num_batches_tracked"}
    for state in (frozen.state_dict(), dict(frozen.state_dict())):  # with and without the version metadata
        target = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8))
        target.load_state_dict(state)
        assert torch.equal(target[1].running_var, plain[1].running_var)
    target = nn.Sequential(nn.Conv2d(3, 8, 1), FrozenBatchNorm2d(8))
    target.load_state_dict(plain.state_dict())  # num_batches_tracked is dropped, as torchvision does
    assert torch.equal(target[1].running_mean, plain[1].running_mean)


def test_batchnorm_without_running_statistics_cannot_be_frozen() -> None:
    net = nn.Sequential(nn.Conv2d(3, 8, 1), nn.Sequential(nn.BatchNorm2d(8, track_running_stats=False)))
    with pytest.raises(ValueError, match=r"1\.0.*track_running_stats=False"):
        convert_frozen_batchnorm(net)


# ------------------------------------------------------------------------------------------ checkpoints
def _assert_loaded(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    own = module.state_dict()
    keys = {k for k in own if not k.endswith("num_batches_tracked")}
    assert keys == {k for k in saved if not k.endswith("num_batches_tracked")}
    for key in keys:
        assert torch.equal(own[key], saved[key]), key


def test_frozen_bn_checkpoints_load_without_the_callback_and_back(tmp_path: Path) -> None:
    # trained with frozen_bn (from "pretrained" statistics), loaded into models without the callback
    source = _module(tmp_path)
    _randomise_statistics(source, seed=1)
    trainer = _trainer(FreezeNorm(mode="frozen_bn"), steps=1)
    trainer.fit(source, train_dataloaders=_loader(1))
    frozen_ckpt = tmp_path / "frozen.ckpt"
    trainer.save_checkpoint(frozen_ckpt)
    saved = torch.load(frozen_ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert not any(key.endswith("num_batches_tracked") for key in saved)

    plain = _module(tmp_path, seed=1)
    assert not torch.equal(plain.state_dict()[BODY + "bn1.running_var"], saved[BODY + "bn1.running_var"])
    _trainer(steps=1).validate(plain, dataloaders=_loader(1), ckpt_path=frozen_ckpt, verbose=False)
    assert _batchnorm_count(plain) > 0
    _assert_loaded(plain, saved)
    _assert_loaded(_module(tmp_path, f"model.weights={frozen_ckpt}", seed=1), saved)  # every tensor fits

    # resuming a frozen_bn run restores weights and optimizer into the converted model
    resumed = _module(tmp_path, seed=1)
    trainer = _trainer(FreezeNorm(mode="frozen_bn"), steps=2)
    trainer.fit(resumed, train_dataloaders=_loader(1), ckpt_path=frozen_ckpt)
    assert trainer.global_step == 2 and _batchnorm_count(resumed) == 0
    source_statistics = _statistics(source)
    for key, value in _statistics(resumed).items():
        assert torch.equal(value, source_statistics[key]), key

    # trained without the callback (with num_batches_tracked), loaded into a frozen_bn model
    trainer = _trainer(steps=1)
    trainer.fit(plain, train_dataloaders=_loader(1))
    plain_ckpt = tmp_path / "plain.ckpt"
    trainer.save_checkpoint(plain_ckpt)
    saved = torch.load(plain_ckpt, map_location="cpu", weights_only=True)["state_dict"]
    assert any(key.endswith("num_batches_tracked") for key in saved)
    target = _module(tmp_path, seed=2)
    assert not torch.equal(target.state_dict()[BODY + "bn1.running_var"], saved[BODY + "bn1.running_var"])
    _trainer(FreezeNorm(mode="frozen_bn"), steps=1).validate(
        target, dataloaders=_loader(1), ckpt_path=plain_ckpt, verbose=False
    )
    assert _batchnorm_count(target) == 0
    _assert_loaded(target, saved)


# ------------------------------------------------------------------------------------------ bad settings
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mode": "x"}, r"^mode='x'.*\['norm_eval', 'frozen_bn'\]"),
        ({"frozen_stages": 5}, r"^frozen_stages=5.*\[-1, 4\]"),
        ({"frozen_stages": -2}, r"^frozen_stages=-2.*\[-1, 4\]"),
        ({"frozen_stages": True}, r"^frozen_stages=True\b"),
        ({"affine_trainable": "no"}, r"^affine_trainable='no'"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs: dict, match: str) -> None:
    """The class names its own argument; the command line adds the config path (see the config test below)."""
    with pytest.raises(ArgumentError, match=match):
        FreezeNorm(**kwargs)


class _NoDetector(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return self.net(torch.randn(2, 3, 4, 4)).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_frozen_stages_need_a_resnet_body_and_fail_before_training() -> None:
    module = _NoDetector()
    with pytest.raises(
        ValueError,
        match=r"frozen_stages=1.*pl_module\.model\.backbone\.body.*_NoDetector\.model.*frozen_stages=-1",
    ):
        _trainer(FreezeNorm(mode="frozen_bn", frozen_stages=1), steps=1).fit(
            module, DataLoader(torch.zeros(4, 1))
        )
    assert module.steps == 0 and isinstance(module.net[1], nn.BatchNorm2d)  # failed before changing anything


def test_missing_stages_are_named() -> None:
    module = _NoDetector()
    module.model = nn.Module()
    module.model.backbone = nn.Module()
    module.model.backbone.body = IntermediateLayerGetter(
        BACKBONES["resnet10"](), {"layer2": "0"}
    )  # drops 3, 4
    FreezeNorm(frozen_stages=2).setup(None, module, "fit")  # stem, layer1, layer2 exist
    assert not module.model.backbone.body.layer2[0].conv1.weight.requires_grad
    with pytest.raises(
        ValueError,
        match=r"frozen_stages=3.*\['layer3'\]",
    ):
        FreezeNorm(frozen_stages=3).setup(None, module, "fit")


def test_no_batchnorm_warns() -> None:
    module = _NoDetector()
    module.net = nn.Conv2d(3, 4, 1)
    with pytest.warns(UserWarning, match=r"BatchNorm.*_NoDetector"):
        FreezeNorm().setup(None, module, "fit")


def test_config_instantiates_and_checks_its_values(tmp_path: Path) -> None:
    cfg = compose_config([*SMOKE, "callbacks=[default,freeze_norm]"], tmp_path)
    callbacks = build_trainer(cfg).callbacks
    (callback,) = [c for c in callbacks if isinstance(c, FreezeNorm)]
    assert repr(callback) == repr(FreezeNorm())  # the YAML's values are the class defaults
    assert "ModelCheckpoint" in {
        type(c).__name__ for c in callbacks
    }  # added to the defaults, not replacing them
    cfg = compose_config(
        [*SMOKE, "callbacks=[default,freeze_norm]", "callbacks.freeze_norm.mode=x"], tmp_path
    )
    with pytest.raises(CONFIG_ERRORS, match=r"callbacks\.freeze_norm\.mode='x'"):
        build_trainer(cfg)

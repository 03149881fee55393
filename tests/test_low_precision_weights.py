"""``trainer.precision=bf16-weights|16-weights``: low-precision weights, fp32 norms, regions and masters."""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torchvision
from hydra.utils import instantiate
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchvision.models.detection._utils import BoxCoder
from torchvision.models.detection.rpn import RegionProposalNetwork

from conftest import compose_config
from lit_amp_det.precision import MasterWeightPrecision, build_precision_plugin
from lit_amp_det.precision.master_weights import NORM_LAYERS, master_weights_of, use_low_precision_weights


def _module(tmp_path: Path, *overrides: str):
    cfg = compose_config(["experiment=smoke", *overrides], tmp_path)
    torch.manual_seed(0)
    return instantiate(cfg.model, _convert_="all", num_classes=4)


def _channels_last_module(tmp_path: Path):
    """The smoke model with NHWC 4-D weights, as ``speedups.channels_last`` makes it."""
    return _module(tmp_path).to(memory_format=torch.channels_last)


def _batch(size: int = 64) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=gen) for _ in range(2)]
    masks = torch.zeros(2, size, size, dtype=torch.uint8)
    masks[0, 10:40, 12:50] = 1
    masks[1, 30:60, 20:44] = 1
    target = {
        "boxes": torch.tensor([[12.0, 10.0, 50.0, 40.0], [20.0, 30.0, 44.0, 60.0]]),
        "labels": torch.tensor([2, 3]),
        "masks": masks,
    }
    return images, [target, {k: v.clone() for k, v in target.items()}]


def _is_norm_param(module: nn.Module, name: str) -> bool:
    owner = module.get_submodule(name.rpartition(".")[0])
    return isinstance(owner, NORM_LAYERS)


@pytest.mark.parametrize("norm", ["bn", "frozen_bn"])
def test_weights_are_bf16_except_norms_and_the_masters_hold_the_fp32_values(
    tmp_path: Path, norm: str
) -> None:
    module = _module(tmp_path, f"model.backbone.norm={norm}")
    before = {k: v.clone() for k, v in module.state_dict().items()}
    plugin = build_precision_plugin("bf16-weights", "cpu")
    plugin.convert_module(module)
    weights = plugin.weights
    params = dict(module.named_parameters())
    assert len(weights) == sum(not _is_norm_param(module, n) for n in params) > 40
    for name, param in params.items():
        expected = torch.float32 if _is_norm_param(module, name) else torch.bfloat16
        assert param.dtype == expected, name
    norm_buffers = [b for m in module.modules() if isinstance(m, NORM_LAYERS) for b in m.buffers()]
    assert norm_buffers and all(b.dtype in (torch.float32, torch.int64) for b in norm_buffers)
    for name, low, master in zip(weights.names, weights.params, weights.masters):
        assert master.dtype == torch.float32 and master.requires_grad == low.requires_grad
        assert torch.equal(master, before[name])  # the fp32 values themselves, not their bf16 rounding
        assert torch.equal(low, before[name].to(torch.bfloat16))
    assert (
        plugin.convert_module(module) is module and master_weights_of(module) is weights
    )  # fit, then validate


def test_channels_last_weights_keep_their_layout_and_get_contiguous_masters(tmp_path: Path) -> None:
    """The bf16 convolution weights stay channels_last (``speedups.channels_last``) while their fp32 masters
    are contiguous: fused optimizers clone and copy back every non-contiguous tensor they step. A fused SGD
    step on the masters then gives what plain SGD gives.
    """
    module = _channels_last_module(tmp_path)
    conv_weights = {n for n, p in module.named_parameters() if p.dim() == 4 and p.shape[-1] > 1}  # 1x1: both
    assert conv_weights and all(
        module.get_parameter(n).is_contiguous(memory_format=torch.channels_last) for n in conv_weights
    )
    plugin = build_precision_plugin("bf16-weights", "cpu")
    plugin.convert_module(module)
    assert conv_weights <= set(plugin.weights.names)  # every checked weight has a master
    for name, low, master in zip(plugin.weights.names, plugin.weights.params, plugin.weights.masters):
        assert master.is_contiguous(), name
        if name in conv_weights:
            assert low.is_contiguous(memory_format=torch.channels_last) and not low.is_contiguous(), name
    masters = {}
    for fused in (False, True):
        copy = _channels_last_module(tmp_path)
        copy.load_state_dict(module.state_dict())
        copy_plugin = build_precision_plugin("bf16-weights", "cpu")
        copy_plugin.convert_module(copy)
        optimizer = torch.optim.SGD(
            [p for p in copy.parameters() if p.requires_grad], lr=0.01, momentum=0.9, fused=fused
        )
        copy_plugin.connect(copy, [optimizer], [])
        copy.train()
        torch.manual_seed(0)
        images, targets = _batch()
        copy.compute_loss(copy.model(copy.prepare_images(images), copy.training_targets(targets))).backward()
        copy_plugin.step_if_finite(optimizer)  # what the plugin's optimizer_step runs after Lightning's hooks
        masters[fused] = [m.detach().clone() for m in copy_plugin.weights.masters]
    assert len(masters[False]) == len(masters[True]) == len(plugin.weights) > 0
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(masters[False], masters[True]))


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(1, 1, bias=False)
        nn.init.ones_(self.linear.weight)


def test_a_step_updates_the_fp32_masters_and_refreshes_the_bf16_weights() -> None:
    """Updates far below bf16's resolution at 1.0 (2**-7) accumulate in the master until the weight moves."""
    model = _Scalar()
    weights = use_low_precision_weights(model, torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    weights.attach(optimizer)
    (master,) = weights.masters
    assert optimizer.param_groups[0]["params"] == [master]
    x = torch.ones(1, 1)
    for step in range(1, 101):
        optimizer.zero_grad(set_to_none=True)
        model.linear(x).float().sum().backward()  # d/dw = 1
        assert model.linear.weight.grad.dtype == torch.bfloat16
        optimizer.step()
        assert model.linear.weight.grad is None and master.grad.dtype == torch.float32
        assert master.item() == pytest.approx(1 - 1e-4 * step, abs=1e-5)  # fp32 rounding of 100 updates
        assert model.linear.weight.item() == master.to(torch.bfloat16).item()
    assert model.linear.weight.item() < 1.0  # plain bf16 SGD would still be at 1.0: 1 - 1e-4 rounds back up


def test_checkpoints_hold_the_fp32_masters_and_load_into_any_precision(tmp_path: Path) -> None:
    module = _module(tmp_path)
    plain = copy.deepcopy(module)
    before = plain.state_dict()
    build_precision_plugin("bf16-weights", "cpu").convert_module(module)
    state = module.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in state)
    inexact = [
        k for k, v in state.items() if v.is_floating_point() and not torch.equal(v, v.bfloat16().float())
    ]
    assert len(inexact) > 30  # so the equality says: full fp32 values, not bf16 ones widened
    plain.load_state_dict(state)  # an fp32 model loads it strictly
    changed = {k: v + 1e-3 if v.is_floating_point() else v for k, v in plain.state_dict().items()}
    module.load_state_dict(changed)  # and an fp32 checkpoint loads into the bf16 model: masters and weights
    weights = master_weights_of(module)
    for name, low, master in zip(weights.names, weights.params, weights.masters):
        assert torch.equal(master, changed[name]) and torch.equal(low, changed[name].to(torch.bfloat16)), name
    copied = copy.deepcopy(module)  # a copy keeps its own masters behind its own state_dict
    copied_masters = master_weights_of(copied).masters
    assert all(a is not b for a, b in zip(copied_masters, weights.masters))
    with torch.no_grad():
        copied_masters[0].add_(1.0)
    assert torch.equal(copied.state_dict()[weights.names[0]], changed[weights.names[0]] + 1.0)


def test_norms_and_fp32_regions_run_in_fp32(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _module(tmp_path)
    seen: dict[str, list[torch.dtype]] = {}

    def record(cls: type, name: str) -> None:
        original = getattr(cls, name)

        def recorder(self, *args, **kwargs):
            seen.setdefault(name, []).extend(
                a.dtype for a in args if isinstance(a, Tensor) and a.is_floating_point()
            )
            return original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, recorder)

    record(RegionProposalNetwork, "compute_loss")
    record(BoxCoder, "decode")
    plugin = build_precision_plugin("bf16-weights", "cpu")
    plugin.convert_module(module)
    body = module.model.backbone.body
    outputs: dict[str, torch.dtype] = {}
    body.layer2.register_forward_hook(lambda m, i, o: outputs.update(layer2=o.dtype))
    module.model.roi_heads.mask_predictor.register_forward_hook(lambda m, i, o: outputs.update(masks=o.dtype))
    running_mean = body.bn1.running_mean.clone()
    images, targets = _batch()
    module.train()
    with plugin.forward_context():
        losses = module.model(module.prepare_images(images), module.training_targets(targets))
    assert outputs == {
        "layer2": torch.bfloat16,
        "masks": torch.float32,
    }  # convolutions low, predictor outputs fp32
    assert body.bn1.running_mean.dtype == torch.float32 and not torch.equal(
        body.bn1.running_mean, running_mean
    )
    assert set(seen["compute_loss"]) == {torch.float32} and set(seen["decode"]) == {torch.float32}
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in losses.values())


def test_a_norm_without_mixed_kernels_gets_fp32_inputs() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.Conv2d(8, 4, 1))
    seen = []
    use_low_precision_weights(model, torch.bfloat16)
    model[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))  # runs after the plugin's
    out = model(torch.randn(2, 3, 8, 8))
    assert seen == [torch.float32] and out.dtype == torch.bfloat16
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16


def test_gradient_equals_bf16_mixed_within_bf16_rounding(tmp_path: Path) -> None:
    """Both run the convolutions on the same bf16-rounded weights; the gradients differ only where the new
    mode sums a shared weight's per-use gradients in bf16 (the RPN head over the FPN levels), so by far less
    than bf16's unit roundoff 2**-8 relative to the whole gradient.
    """
    base = _module(tmp_path)
    images, targets = _batch(96)

    def step(precision: str) -> tuple[dict[str, Tensor], Tensor]:
        module = copy.deepcopy(base)
        plugin = build_precision_plugin(precision, "cpu")
        plugin.convert_module(module)
        module.train()
        torch.manual_seed(1)  # the samplers draw the same proposals
        with plugin.forward_context():
            losses = module.model(module.prepare_images(images), module.training_targets(targets))
        module.compute_loss(losses).backward()
        weights = master_weights_of(module)
        masters = {} if weights is None else dict(zip(weights.names, weights.masters))
        if weights is not None:
            weights.grads_to_masters()
        grads = [masters.get(name, param).grad for name, param in module.named_parameters()]
        return losses, torch.cat([g.flatten().double() for g in grads if g is not None])

    mixed_losses, mixed = step("bf16-mixed")
    losses, grad = step("bf16-weights")
    for key, value in mixed_losses.items():
        torch.testing.assert_close(losses[key], value, rtol=1e-6, atol=1e-7)
    assert mixed.norm() > 0 and grad.shape == mixed.shape
    assert (grad - mixed).norm() <= 2**-8 * mixed.norm(), float((grad - mixed).norm() / mixed.norm())


def test_torchvision_roi_ops_run_as_fp32_regions(tmp_path: Path) -> None:
    """torchvision's RoIAlign refuses bf16 features with fp32 boxes outside autocast; the plugin runs it in
    fp32.
    """
    module = _module(tmp_path)  # torchvision's model as built, its RoI ops included
    assert type(module.model.roi_heads.box_roi_pool) is torchvision.ops.MultiScaleRoIAlign
    plugin = build_precision_plugin("bf16-weights", "cpu")
    plugin.convert_module(module)
    images, targets = _batch()
    module.train()
    losses = module.model(module.prepare_images(images), module.training_targets(targets))
    assert all(torch.isfinite(v) for v in losses.values())


# ------------------------------------------------------------------------------------------- with Lightning


class _Fit(pl.LightningModule):
    """The smoke Mask R-CNN on a fixed list of batches, SGD with momentum (constant lr); the samplers draw
    from a seed per step, so a resumed run draws what the straight one drew without restoring any RNG.
    """

    def __init__(self, detector_module: pl.LightningModule) -> None:
        super().__init__()
        self.inner = detector_module
        self.batches = [_batch(), _batch()]
        self.grads_seen: list[set[torch.dtype | None]] = []  # per step: dtypes of the optimizer's gradients
        self.model_grads_seen: list[set[torch.dtype | None]] = []  # per step: dtypes of the model's gradients

    def on_before_optimizer_step(self, optimizer) -> None:  # where clipping and grad-norm logging look
        self.grads_seen.append(
            {
                None if p.grad is None else p.grad.dtype
                for group in optimizer.param_groups
                for p in group["params"]
            }
        )
        self.model_grads_seen.append({None if p.grad is None else p.grad.dtype for p in self.parameters()})

    def fp32_regions(self) -> dict[str, str]:
        return {f"inner.{k}": v for k, v in self.inner.fp32_regions().items()}

    def training_step(self, batch, batch_idx):
        torch.manual_seed(self.global_step)
        images, targets = batch
        losses = self.inner.model(self.inner.prepare_images(images), self.inner.training_targets(targets))
        return self.inner.compute_loss(losses)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(
            self.batches, batch_size=None, collate_fn=lambda batch: batch
        )  # one item, one batch


def _trainer(max_steps: int, precision: str, root: Path, **kwargs) -> pl.Trainer:
    plugin = build_precision_plugin(precision, "cpu", fp16_on_cpu=True)
    return pl.Trainer(
        max_steps=max_steps,
        plugins=[plugin],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        default_root_dir=root,
        deterministic=True,
        **kwargs,
    )


def test_fit_checkpoint_and_resume_continue_exactly(tmp_path: Path) -> None:
    """2 + 2 steps with a checkpoint in between end where 4 straight steps end; the checkpoint is fp32. The
    hooks see the fp32 master gradients.
    """

    def fresh() -> _Fit:
        return _Fit(_module(tmp_path))

    straight = fresh()
    _trainer(4, "bf16-weights", tmp_path / "a", enable_checkpointing=False).fit(straight)
    first = fresh()
    trainer = _trainer(2, "bf16-weights", tmp_path / "b", enable_checkpointing=False)
    trainer.fit(first)
    assert isinstance(trainer.precision_plugin, MasterWeightPrecision)
    assert first.grads_seen == [{torch.float32}, {torch.float32}]  # fp32 master gradients, all present
    assert {p.dtype for g in trainer.optimizers[0].param_groups for p in g["params"]} == {torch.float32}
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    saved = torch.load(tmp_path / "mid.ckpt", weights_only=True)
    assert {v.dtype for v in saved["state_dict"].values() if v.is_floating_point()} == {torch.float32}
    assert saved["MasterWeightPrecision"]["guard"] == {"skipped": 0, "consecutive": 0}
    resumed = fresh()
    resuming = _trainer(4, "bf16-weights", tmp_path / "c", enable_checkpointing=False)
    resuming.fit(resumed, ckpt_path=tmp_path / "mid.ckpt")
    expected, got = straight.state_dict(), resumed.state_dict()
    assert expected.keys() == got.keys()
    moved = [k for k in expected if not torch.equal(expected[k], saved["state_dict"][k])]
    assert len(moved) > 40  # the last two steps changed the weights
    for key, value in expected.items():
        assert torch.equal(value, got[key]), key


@pytest.mark.parametrize("precision", ["bf16-weights", "16-weights"])
def test_inf_gradients_skip_the_step_and_fp16_scales_the_loss(precision: str) -> None:
    """The step guard and (fp16) the GradScaler act on the masters: a poisoned step changes nothing."""
    from test_precision_plugin import _fit as fit_linear
    from test_precision_plugin import _Linear

    plugin = build_precision_plugin(precision, "cpu", fp16_on_cpu=True, init_scale=256.0)
    module = _Linear(poison_steps={2})
    losses: list[float] = []
    scaled: list[float] = []
    training_step = module.training_step
    module.training_step = lambda *args: losses.append(float((out := training_step(*args)).detach())) or out
    module.on_before_backward = lambda loss: scaled.append(float(loss.detach()))
    fit_linear(module, plugin, steps=8)
    assert module.layer.weight.dtype == (torch.bfloat16 if precision == "bf16-weights" else torch.float16)
    assert plugin.guard.skipped == 1 and module.weights[2] == module.weights[1]
    assert abs(module.weights[-1] - 2.0) < abs(module.weights[0] - 2.0)
    assert len(scaled) == len(losses) == 8
    if precision == "16-weights":
        assert plugin.scaler.get_scale() == 128.0  # backed off once from 256
        assert scaled[0] == pytest.approx(256.0 * losses[0])  # the loss was scaled before backward
    assert all(bool(torch.isfinite(p).all()) for p in plugin.weights.masters)


def test_memory_baseline_takes_half_weights_and_run_stats_count_the_masters(tmp_path: Path) -> None:
    """MemoryMonitor's fp32 baseline of a half-weights run is measured on a copy with the masters as weights,
    so ``-weights`` is comparable while ``-true`` (no fp32 copies anywhere) is refused with the fix named; the
    order-free tensor-memory figure counts the fp32 masters and their gradients, which the model's
    ``parameters()`` do not list.
    """
    from types import SimpleNamespace

    from lit_amp_det.callbacks.memory_savings import check_comparable
    from lit_amp_det.callbacks.run_stats import resident_training_bytes

    module = _module(tmp_path)
    plugin = build_precision_plugin("bf16-weights", "cpu")
    plugin.convert_module(module)
    check_comparable(SimpleNamespace(precision_plugin=plugin), module)
    with pytest.raises(
        ValueError,
        match=r"trainer\.precision=bf16-true.*callbacks\.memory_monitor\.compare_baseline=false",
    ):
        check_comparable(SimpleNamespace(precision_plugin=SimpleNamespace(precision="bf16-true")), module)
    optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.01)
    plugin.connect(module, [optimizer], [])
    low = sum(p.numel() * p.element_size() for p in module.parameters())
    masters = sum(m.numel() * 4 for m in plugin.weights.masters)
    assert resident_training_bytes(module, [optimizer]) == low + masters


def test_a_full_precision_copy_is_the_model_as_fp32_training_would_have_it(tmp_path: Path) -> None:
    """``full_precision_copy``: the masters (not their bf16 rounding) as parameters in the weights' memory
    format, no casting hooks or masters left, the same losses and gradients as an fp32 model with those
    values; the converted model is untouched.
    """
    from lit_amp_det.precision.master_weights import full_precision_copy

    module = _channels_last_module(tmp_path)
    plugin = build_precision_plugin("bf16-weights", "cpu")
    plugin.convert_module(module)
    with torch.no_grad():  # masters off the bf16 grid, as after fp32 updates too small for the bf16 weights
        for master in plugin.weights.masters:
            master.add_(1e-4)
    fp32 = _channels_last_module(tmp_path)
    fp32.load_state_dict(module.state_dict())  # the masters' values
    low_before = {n: p.detach().clone() for n, p in module.named_parameters()}

    assert full_precision_copy(module.model).state_dict().keys() == module.model.state_dict().keys()  # a part
    full = full_precision_copy(module)
    assert master_weights_of(full) is None and master_weights_of(module) is plugin.weights
    params = dict(full.named_parameters())
    assert params.keys() == dict(fp32.named_parameters()).keys()
    for name, param in fp32.named_parameters():
        assert params[name].dtype == torch.float32 and torch.equal(params[name], param), name
        assert params[name].stride() == module.get_parameter(name).stride(), name  # channels_last kept
    hooks = [
        h
        for m in full.modules()
        for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values(), *m._state_dict_hooks.values())
    ]
    assert not [h for h in hooks if h.__module__ == "lit_amp_det.precision.master_weights"]
    assert {k: v.dtype for k, v in full.state_dict().items()} == {
        k: v.dtype for k, v in fp32.state_dict().items()
    }
    full.load_state_dict(fp32.state_dict())  # no master hooks left to trip over

    full.train(), fp32.train()
    losses = []
    for model in (full, fp32):
        torch.manual_seed(0)
        loss_dict = model.model(model.prepare_images(_batch()[0]), _batch()[1])
        loss = model.compute_loss(loss_dict)
        loss.backward()
        losses.append((loss.detach(), [p.grad for p in model.parameters()]))
    assert losses[0][0].dtype == torch.float32 and torch.equal(losses[0][0], losses[1][0])
    compared = [(a, b) for a, b in zip(losses[0][1], losses[1][1]) if b is not None]
    assert len(compared) > 40 and all(a is not None and torch.equal(a, b) for a, b in compared)
    assert all(
        torch.equal(p, low_before[n]) and p.dtype in (torch.bfloat16, torch.float32)
        for n, p in module.named_parameters()
    )
    with pytest.raises(ValueError, match="no fp32 masters"):
        full_precision_copy(fp32)


def _recording_buffer(fresh: list[int], buffer_for, index: int, master: Tensor) -> Tensor:
    """``MasterWeights._grad_buffer`` that records which master got a new gradient buffer."""
    fresh.append(index)
    return buffer_for(index, master)


def test_gradients_add_onto_master_gradients_left_by_zero_grad_without_set_to_none() -> None:
    """``zero_grad(set_to_none=False)`` keeps the masters' gradient tensors (zeroed): the next bf16 gradient
    is added onto them in fp32 instead of replacing them, and the step is the same as with
    ``set_to_none=True``.
    """
    results = []
    for set_to_none in (True, False):
        model = _Scalar()
        weights = use_low_precision_weights(model, torch.bfloat16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
        weights.attach(optimizer)
        (master,) = weights.masters
        fresh = []  # steps that gave the master a new gradient (the buffer), not one added onto the kept one
        buffer_for = weights._grad_buffer
        weights._grad_buffer = functools.partial(_recording_buffer, fresh, buffer_for)
        for _ in range(3):
            optimizer.zero_grad(set_to_none=set_to_none)
            (model.linear(torch.full((1, 1), 2.0)).float() * 3).sum().backward()  # d/dw = 6
            optimizer.step()
            assert master.grad.dtype == torch.float32 and float(master.grad) == 6.0
        assert len(fresh) == (3 if set_to_none else 1)  # kept gradients take the adding branch
        results.append(float(master.detach()))
    assert results[0] == results[1] == 1.0 - 3 * 0.25 * 6.0


class _TinyConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.norm(self.conv(x)).mean((2, 3)))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_skipped_step_leaves_the_masters_the_weights_and_the_optimizer_state_unchanged(
    optimizer: str,
) -> None:
    """``bf16-weights`` steps AdamW (or SGD with momentum and weight decay) through the guard: a step with a
    NaN gradient leaves the fp32 masters, the bf16 weights and every optimizer state tensor (AdamW's step
    count too) as they were; the steps around it train.
    """
    model = _TinyConvNet()
    plugin = build_precision_plugin("bf16-weights", "cpu")
    plugin.convert_module(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = (
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if optimizer == "adamw"
        else torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=1e-2)
    )
    plugin.connect(model, [opt], [])
    x = torch.randn(3, 2, 6, 6, generator=torch.Generator().manual_seed(1))

    def step(poison: bool) -> None:
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        if poison:
            model.conv.weight.grad[0, 0, 0, 0] = math.nan
        plugin.step_if_finite(opt)

    def snapshot() -> list[Tensor]:
        state = [v.clone() for p in params_of(opt) for v in opt.state[p].values() if isinstance(v, Tensor)]
        weights = [p.detach().clone() for p in model.parameters()]
        return weights + [m.detach().clone() for m in plugin.weights.masters] + state

    def params_of(o: torch.optim.Optimizer) -> list[Tensor]:
        return [p for group in o.param_groups for p in group["params"]]

    for _ in range(2):
        step(poison=False)
    before = snapshot()
    step(poison=True)
    after = snapshot()
    assert len(after) == len(before) > 2 * len(plugin.weights.masters)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert plugin.guard.skipped == 1
    step(poison=False)
    assert not torch.equal(snapshot()[0], before[0])
    assert all(torch.equal(low, master.to(low.dtype)) for low, master in plugin.weights.pairs())

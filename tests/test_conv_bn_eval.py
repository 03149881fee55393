"""Tune-mode conv-BN (lit_amp_det.models.conv_bn, ConvBNEval): equivalence with conv -> norm, pairing,
callback.
"""

from __future__ import annotations

import copy
import logging
import pickle
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision
from hydra.utils import instantiate
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from torchvision.ops import Conv2dNormActivation, FrozenBatchNorm2d

from conftest import SMOKE, compose_config, smooth_activations
from lit_amp_det.callbacks.conv_bn_eval import ConvBNEval
from lit_amp_det.models.conv_bn import (
    NORM_TYPES,
    conv_bn_eval_enabled,
    conv_bn_eval_pairs,
    disable_conv_bn_eval,
    enable_conv_bn_eval,
    find_conv_norm_pairs,
    fold_conv_bn,
)
from lit_amp_det.models.maskrcnn import build_detector

PAIRS = {"resnet18": 20, "resnet50": 53}


# --------------------------------------------------------------------------------------------- helpers


def _randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial statistics and affine values, so the fold is far from the identity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, NORM_TYPES):
                c = m.running_mean.shape[0]
                m.running_mean.copy_(torch.randn(c, generator=gen) * 0.5)
                m.running_var.copy_(torch.rand(c, generator=gen) * 1.5 + 0.5)
                m.weight.copy_(torch.rand(c, generator=gen) + 0.5)
                m.bias.copy_(torch.randn(c, generator=gen) * 0.2)
    return model


def _norm_eval(model: nn.Module) -> nn.Module:
    model.train()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    return model


def _resnet(name: str, **kwargs: object) -> nn.Module:
    torch.manual_seed(0)
    return _randomize_norms(getattr(torchvision.models, name)(**kwargs))


def _pair_of_models(model: nn.Module, only_when_cheaper: bool = False) -> tuple[nn.Module, nn.Module]:
    folded = copy.deepcopy(model)
    assert enable_conv_bn_eval(folded, only_when_cheaper=only_when_cheaper)
    return model, folded


@contextmanager
def _norm_calls(model: nn.Module) -> Iterator[Counter]:
    """Counts norm calls that passed the folded conv output through ("folded") or normalised ("plain")."""
    counts: Counter = Counter()

    def hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        counts["folded" if output is args[0] else "plain"] += 1

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, NORM_TYPES)]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()


def _assert_rel(actual: Tensor, expected: Tensor, tol: float, what: str) -> None:
    err = ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def _assert_grads_match(plain: nn.Module, folded: nn.Module, tol: float) -> int:
    """Compares every parameter gradient; returns how many were compared (never zero)."""
    compared = 0
    for (name, p), q in zip(plain.named_parameters(), folded.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            _assert_rel(q.grad, p.grad, tol, f"grad of {name}")
            compared += 1
    assert compared > 0
    return compared


def _forward_backward(model: nn.Module, x: Tensor, loss: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    x = x.clone().requires_grad_(True)
    out = model(x)
    loss(out).backward()
    return out.detach(), x.grad


def _square(out: Tensor) -> Tensor:
    return out.float().square().mean()


# ----------------------------------------------------------------------------------- equivalence, fp32


@pytest.mark.parametrize("name", list(PAIRS))
def test_outputs_and_gradients_match_plain_resnet_in_norm_eval(name: str) -> None:
    plain, folded = _pair_of_models(_norm_eval(_resnet(name)))
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    out_plain, dx_plain = _forward_backward(plain, x, _square)
    with _norm_calls(folded) as calls:
        out_folded, dx_folded = _forward_backward(folded, x, _square)
    assert calls == {"folded": PAIRS[name]}  # every pair really ran folded
    _assert_rel(out_folded, out_plain, 1e-5, "output")
    _assert_rel(dx_folded, dx_plain, 1e-5, "input gradient")
    # conv weights, BatchNorm weight and bias, fc
    assert _assert_grads_match(plain, folded, 1e-5) == len(list(plain.parameters()))


@pytest.mark.parametrize(
    "conv",
    [
        dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, bias=True),
        dict(
            in_channels=4,
            out_channels=8,
            kernel_size=3,
            stride=2,
            padding=2,
            dilation=2,
            groups=2,
            bias=False,
        ),
        dict(in_channels=6, out_channels=6, kernel_size=(3, 1), padding="same", groups=6, bias=True),
        dict(in_channels=4, out_channels=5, kernel_size=(1, 3), stride=(2, 1), padding="valid", bias=False),
    ],
    ids=["bias", "groups-dilation-stride", "depthwise-same", "valid-rect"],
)
@pytest.mark.parametrize("norm", ["bn", "frozen"])
def test_conv_settings_and_bias_are_honoured(conv: dict, norm: str) -> None:
    torch.manual_seed(0)
    make = nn.BatchNorm2d if norm == "bn" else FrozenBatchNorm2d
    model = _randomize_norms(nn.Sequential(nn.Conv2d(**conv), make(conv["out_channels"]), nn.ReLU()))
    if conv["bias"]:
        nn.init.normal_(model[0].bias)
    plain, folded = _pair_of_models(_norm_eval(model))
    assert conv_bn_eval_pairs(folded) == [("0", "1")]
    x = torch.randn(2, conv["in_channels"], 9, 10)
    out_plain, dx_plain = _forward_backward(plain, x, _square)
    with _norm_calls(folded) as calls:
        out_folded, dx_folded = _forward_backward(folded, x, _square)
    assert calls == {"folded": 1}
    _assert_rel(out_folded, out_plain, 1e-5, "output")
    _assert_rel(dx_folded, dx_plain, 1e-5, "input gradient")
    _assert_grads_match(plain, folded, 1e-5)


def test_frozen_batchnorm_and_subclasses_fold() -> None:
    class MyFrozen(FrozenBatchNorm2d):
        pass

    torch.manual_seed(0)
    model = _randomize_norms(torchvision.models.resnet18(norm_layer=MyFrozen))
    assert len(find_conv_norm_pairs(model)) == PAIRS["resnet18"]
    plain, folded = _pair_of_models(model.train())  # frozen norms fold in train mode too
    x = torch.randn(2, 3, 64, 64)
    out_plain, dx_plain = _forward_backward(plain, x, _square)
    with _norm_calls(folded) as calls:
        out_folded, dx_folded = _forward_backward(folded, x, _square)
    assert calls == {"folded": PAIRS["resnet18"]}
    _assert_rel(out_folded, out_plain, 1e-5, "output")
    _assert_rel(dx_folded, dx_plain, 1e-5, "input gradient")
    assert _assert_grads_match(plain, folded, 1e-5) == 20 + 2  # conv weights and fc; frozen norms have none


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tiny_maskrcnn_losses_and_gradients_match(dtype: torch.dtype) -> None:
    """Losses in fp32 and float64; gradients in float64 only: the detector is ill-conditioned in fp32 (in the
    plain model, moving the running means by 1e-6 moves the stem's weight gradient by 4e-4 and, with one torch
    thread on an AVX-512 CPU, loss_classifier by 5e-5), so fp32 losses get 2e-4; a wrong fold moves them by
    far more.
    """
    torch.manual_seed(0)
    model = build_detector(
        7,
        backbone={"name": "resnet10", "fpn_channels": 32},
        transform={"min_size": 128, "max_size": 128},
        roi_heads={"box_head_width": 64, "mask_head_layers": [16]},
    )
    plain, folded = _pair_of_models(_norm_eval(_randomize_norms(model)).to(dtype))
    assert len(conv_bn_eval_pairs(folded)) == 12
    gen = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 128, 128, generator=gen, dtype=dtype) for _ in range(2)]
    masks = torch.zeros(2, 128, 128, dtype=torch.uint8)
    masks[0, 10:60, 20:90], masks[1, 70:120, 30:100] = 1, 1
    targets = [
        {
            "boxes": torch.tensor([[20.0, 10.0, 90.0, 60.0], [30.0, 70.0, 100.0, 120.0]], dtype=dtype),
            "labels": torch.tensor([1, 4]),
            "masks": masks,
        }
    ] * 2

    def loss(m: nn.Module) -> dict[str, Tensor]:
        torch.manual_seed(1)  # the RPN and RoI samplers draw from the global RNG
        losses = m(images, targets)
        sum(losses.values()).backward()
        return losses

    expected = loss(plain)
    with _norm_calls(folded) as calls:
        actual = loss(folded)
    assert calls == {"folded": 12}
    assert sorted(actual) == sorted(expected) and len(expected) == 5
    for key in expected:
        _assert_rel(
            actual[key].detach(), expected[key].detach(), 2e-4 if dtype == torch.float32 else 1e-10, key
        )
    if dtype == torch.float64:
        _assert_grads_match(plain, folded, 1e-10)


def test_parameters_stay_equal_over_sgd_steps() -> None:
    plain, folded = _pair_of_models(_norm_eval(smooth_activations(_resnet("resnet18", num_classes=5))))
    optimizers = [
        torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4) for m in (plain, folded)
    ]
    gen = torch.Generator().manual_seed(2)
    batches = [
        (torch.randn(2, 3, 48, 48, generator=gen), torch.randint(0, 5, (2,), generator=gen)) for _ in range(4)
    ]
    for x, y in batches:
        for model, optimizer in zip((plain, folded), optimizers):
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    start = _resnet("resnet18", num_classes=5)
    moved = 0
    for (name, p), q, p0 in zip(
        plain.named_parameters(), folded.parameters(), start.parameters(), strict=True
    ):
        assert torch.isfinite(p).all(), name
        _assert_rel(q.detach(), p.detach(), 1e-5, name)
        moved += int(not torch.equal(p, p0))
    assert moved == len(list(plain.parameters()))  # every parameter trained, BatchNorm affine included
    for (name, a), b, b0 in zip(plain.named_buffers(), folded.buffers(), start.buffers(), strict=True):
        assert torch.equal(a, b0) and torch.equal(b, b0), (
            f"{name} changed: statistics stay fixed in eval mode"
        )


# ------------------------------------------------------------------------------------- per-call decisions


def test_train_mode_batchnorm_falls_back_to_plain_training() -> None:
    plain, folded = _pair_of_models(_resnet("resnet18").train())
    x = torch.randn(4, 3, 32, 32)
    out_plain, dx_plain = _forward_backward(plain, x, _square)
    with _norm_calls(folded) as calls:
        out_folded, dx_folded = _forward_backward(folded, x, _square)
    assert calls == {"plain": PAIRS["resnet18"]}
    assert torch.equal(out_folded, out_plain) and torch.equal(dx_folded, dx_plain)
    for (name, a), b in zip(plain.named_buffers(), folded.buffers(), strict=True):
        assert torch.equal(a, b), name  # running statistics updated exactly as in plain training
    assert plain.bn1.num_batches_tracked.item() == 1
    # the same installation folds as soon as the norms are put in eval mode
    with _norm_calls(_norm_eval(folded)) as calls:
        folded(x)
    assert calls == {"folded": PAIRS["resnet18"]}


def test_only_when_cheaper_compares_activation_with_weight_copy() -> None:
    torch.manual_seed(0)
    model = _norm_eval(
        _randomize_norms(nn.Sequential(nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32)))
    )
    assert enable_conv_bn_eval(model) == [("0", "1")]  # only_when_cheaper=True by default
    weight = 32 * 32 * 9
    small, large = torch.randn(1, 32, 4, 4), torch.randn(2, 32, 16, 16)
    assert 32 * 4 * 4 < weight < 2 * 32 * 16 * 16
    for x, expected in ((small, "plain"), (large, "folded")):
        with _norm_calls(model) as calls:
            model(x).sum().backward()
        assert calls == {expected: 1}, x.shape
    with (
        torch.no_grad(),
        _norm_calls(model) as calls,
    ):  # nothing is saved for backward: folding only saves work
        model(small)
    assert calls == {"folded": 1}
    with torch.autocast("cpu", dtype=torch.bfloat16), _norm_calls(model) as calls:
        model(small).sum().backward()  # the same rule under autocast
    assert calls == {"plain": 1}
    enable_conv_bn_eval(model, only_when_cheaper=False)
    with _norm_calls(model) as calls:
        model(small).sum().backward()
    assert calls == {"folded": 1}


def test_only_when_cheaper_leaves_frozen_batchnorm_unfolded_while_recording_gradients() -> None:
    torch.manual_seed(0)
    model = _randomize_norms(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), FrozenBatchNorm2d(8)))
    enable_conv_bn_eval(model)
    x = torch.randn(
        4, 8, 32, 32
    )  # the output outweighs the weight, but FrozenBatchNorm2d keeps no activation
    expected = {"fp32": "plain", "bf16 autocast": "plain", "no_grad": "folded", "frozen conv": "folded"}
    for case, outcome in expected.items():
        model[0].requires_grad_(case != "frozen conv")
        with (
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "bf16 autocast"),
            torch.set_grad_enabled(case != "no_grad"),
            _norm_calls(model) as calls,
        ):
            model(x)
        assert calls == {outcome: 1}, case


def test_autocast_bf16_is_as_accurate_as_plain_autocast() -> None:
    """bf16 rounding differs between the two (the folded weight is rounded, not the BatchNorm output), so each
    is compared with the fp32 model: the fold must not be less accurate than plain autocast.
    """
    reference, plain = _pair_of_models(_norm_eval(_resnet("resnet18")))
    disable_conv_bn_eval(plain)
    folded = copy.deepcopy(reference)
    enable_conv_bn_eval(folded, only_when_cheaper=False)
    x = torch.randn(2, 3, 64, 64)
    out_ref, dx_ref = _forward_backward(reference, x, _square)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_plain, dx_plain = _forward_backward(plain, x, _square)
        with _norm_calls(folded) as calls:
            out_folded, dx_folded = _forward_backward(folded, x, _square)
    assert calls == {"folded": PAIRS["resnet18"]}
    assert out_folded.dtype == out_plain.dtype == torch.bfloat16

    def error(a: Tensor, b: Tensor) -> float:
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    def grads(model: nn.Module) -> Tensor:
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    overall = [
        ("output", out_plain, out_folded, out_ref),
        ("input gradient", dx_plain, dx_folded, dx_ref),
        ("all parameter gradients", grads(plain), grads(folded), grads(reference)),
    ]
    for what, a, b, ref in overall:
        assert error(b, ref) <= 1.5 * error(a, ref) + 5e-3, (what, error(b, ref), error(a, ref))
    # per tensor, bf16 rounding lands differently (measured ratios 0.5x to 1.9x, either way)
    for (name, p), q, r in zip(
        plain.named_parameters(), folded.parameters(), reference.parameters(), strict=True
    ):
        assert error(q.grad, r.grad) <= 2.5 * error(p.grad, r.grad) + 5e-3, name
    assert error(out_folded, out_ref) < 2e-2


# ------------------------------------------------------------------------------------------------ pairing


class _SecondUser(nn.Module):
    """conv1 -> bn1 is a pair; conv2's output also feeds the residual add, and shared is called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.shared, self.bn3 = nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv2(self.bn1(self.conv1(x)))
        y = self.bn2(y) + y
        return self.bn3(self.shared(self.shared(y)))


def test_conv_whose_output_has_a_second_user_is_not_paired() -> None:
    model = _norm_eval(_randomize_norms(_SecondUser()))
    assert find_conv_norm_pairs(model) == [("conv1", "bn1")]
    plain, folded = _pair_of_models(model)
    x = torch.randn(2, 3, 16, 16)
    out_plain, _ = _forward_backward(plain, x, _square)
    with _norm_calls(folded) as calls:
        out_folded, _ = _forward_backward(folded, x, _square)
    assert calls == {"folded": 1, "plain": 2}
    _assert_rel(out_folded, out_plain, 1e-5, "output")


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "tiny_maskrcnn", "mobilenet_v2"])
def test_fx_pairs_equal_structural_walk(name: str) -> None:
    if name == "tiny_maskrcnn":
        model = build_detector(7, backbone={"name": "resnet10", "fpn_channels": 32})
        expected = 12
    else:
        model = getattr(torchvision.models, name)()
        expected = {"resnet18": 20, "resnet50": 53, "mobilenet_v2": 52}[name]
    pairs = find_conv_norm_pairs(model)
    assert len(pairs) == expected
    assert find_conv_norm_pairs(model, method="structure") == pairs
    if name == "tiny_maskrcnn":
        assert pairs[0] == ("backbone.body.conv1", "backbone.body.bn1")
        assert ("backbone.body.layer2.0.downsample.0", "backbone.body.layer2.0.downsample.1") in pairs


def test_structural_walk_respects_returned_conv_and_sequentials() -> None:
    body = torchvision.models._utils.IntermediateLayerGetter(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4)),
        return_layers={"2": "out", "3": "normed"},
    )
    stack = nn.Sequential(Conv2dNormActivation(3, 4), Conv2dNormActivation(4, 4, norm_layer=None))
    for model, expected in ((body, [("0", "1")]), (stack, [("0.0", "0.1")])):
        assert find_conv_norm_pairs(model, method="structure") == expected
        assert find_conv_norm_pairs(model) == expected


def test_find_rejects_unknown_method() -> None:
    with pytest.raises(ValueError, match="'auto' or 'structure'"):
        find_conv_norm_pairs(nn.Conv2d(1, 1, 1), method="fx")


# ----------------------------------------------------------------------- state dict, copies, permanent fold


def test_state_dict_keys_unchanged_and_round_trip(tmp_path: Path) -> None:
    plain, folded = _pair_of_models(_norm_eval(_resnet("resnet18")))
    assert list(folded.state_dict()) == list(plain.state_dict())
    x = torch.randn(2, 3, 32, 32)
    torch.save(folded.state_dict(), tmp_path / "on.pt")
    torch.save(plain.state_dict(), tmp_path / "off.pt")
    fresh_plain = _norm_eval(torchvision.models.resnet18())
    fresh_folded = copy.deepcopy(fresh_plain)
    enable_conv_bn_eval(fresh_folded)
    fresh_plain.load_state_dict(torch.load(tmp_path / "on.pt", weights_only=True), strict=True)
    fresh_folded.load_state_dict(torch.load(tmp_path / "off.pt", weights_only=True), strict=True)
    _assert_rel(fresh_plain(x), plain(x), 1e-5, "saved with the fold on, loaded without")
    _assert_rel(fresh_folded(x), plain(x), 1e-5, "saved without, loaded with the fold on")


def test_deepcopy_and_pickle_of_enabled_model_stay_consistent() -> None:
    plain, folded = _pair_of_models(_norm_eval(_resnet("resnet18")))
    x = torch.randn(2, 3, 32, 32)
    clone = copy.deepcopy(folded)
    unpickled = pickle.loads(pickle.dumps(folded))
    for other in (clone, unpickled):
        assert conv_bn_eval_pairs(other) == conv_bn_eval_pairs(folded)
        with torch.no_grad():
            other.layer1[0].bn1.running_var.mul_(3.0)  # reaches the copy's fold, not the original's
        reference = copy.deepcopy(plain)
        with torch.no_grad():
            reference.layer1[0].bn1.running_var.mul_(3.0)
        with _norm_calls(other) as calls:
            _assert_rel(other(x), reference(x), 1e-5, "copy")
        assert calls == {"folded": PAIRS["resnet18"]}
    disable_conv_bn_eval(clone)  # what MemoryMonitor does for its baseline
    assert not conv_bn_eval_enabled(clone) and conv_bn_eval_enabled(folded)
    with _norm_calls(clone) as calls:
        clone(x)
    assert calls == {"plain": PAIRS["resnet18"]}
    _assert_rel(folded(x), plain(x), 1e-5, "original after disabling the copy")


def test_activation_checkpointing_recomputes_the_same_fold() -> None:
    plain, folded = _pair_of_models(_norm_eval(_resnet("resnet18")))
    x = torch.randn(2, 3, 32, 32)

    def run(model: nn.Module) -> Tensor:
        stem = model.maxpool(model.relu(model.bn1(model.conv1(x))))
        out = torch.utils.checkpoint.checkpoint(model.layer1, stem, use_reentrant=False)
        out.square().mean().backward()
        return out.detach()

    expected = run(plain)
    with _norm_calls(folded) as calls:
        actual = run(folded)
    assert calls == {"folded": 1 + 4 + 4}  # stem, layer1 forward, layer1 recomputed in backward
    _assert_rel(actual, expected, 1e-5, "output")
    _assert_grads_match(plain, folded, 1e-5)


def test_disable_restores_class_forward() -> None:
    plain, folded = _pair_of_models(_norm_eval(_resnet("resnet18")))
    disable_conv_bn_eval(folded)
    assert not conv_bn_eval_enabled(folded) and conv_bn_eval_pairs(folded) == []
    assert all("forward" not in vars(m) for m in folded.modules())
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(folded(x), plain(x))


def test_fold_conv_bn_equals_eval_output() -> None:
    model = _resnet("resnet18").eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
        enable_conv_bn_eval(model)  # folding an enabled model removes the on-the-fly fold first
        fold_conv_bn(model)
        actual = model(x)
    _assert_rel(actual, expected, 1e-5, "permanently folded output")
    assert not any(isinstance(m, NORM_TYPES) for m in model.modules()) and not conv_bn_eval_enabled(model)
    assert "bn1.weight" not in model.state_dict() and "conv1.bias" in model.state_dict()
    with pytest.raises(ValueError, match="model.eval"):
        fold_conv_bn(_resnet("resnet18").train())


def test_mismatched_norm_input_raises_instead_of_normalising_twice() -> None:
    plain, folded = _pair_of_models(_norm_eval(_resnet("resnet18")))
    folded.conv1.register_forward_hook(lambda module, args, output: output * 1.0)
    with pytest.raises(RuntimeError, match="'bn1' received a tensor other than the folded output of 'conv1'"):
        folded(torch.randn(1, 3, 32, 32))


# ------------------------------------------------------------------------------------------------ callback


class _Classifier(LightningModule):
    """A resnet18 classifier trained in norm_eval (BatchNorm put in eval mode before every batch)."""

    def __init__(self, swap_to_frozen: bool = False) -> None:
        super().__init__()
        self.model = smooth_activations(
            _resnet("resnet18", num_classes=4)
        )  # no ReLU kink: see smooth_activations
        self.swap_to_frozen = swap_to_frozen
        self.losses: list[Tensor] = []
        self.norm_calls: Counter = Counter()

    def configure_model(self) -> None:
        # runs after the callbacks' setup(): replaces modules the way a strategy's sync_batchnorm would
        if self.swap_to_frozen:
            for _, child in list(self.model.named_modules()):
                for child_name, norm in list(child.named_children()):
                    if isinstance(norm, nn.BatchNorm2d):
                        frozen = FrozenBatchNorm2d(norm.num_features)
                        frozen.load_state_dict(norm.state_dict(), strict=False)
                        setattr(child, child_name, frozen)

    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        _norm_eval(self.model)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        with _norm_calls(self.model) as calls:
            loss = F.cross_entropy(self.model(x), y)
        self.norm_calls.update(calls)
        self.losses.append(loss.detach())
        return loss

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.model(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _loader() -> DataLoader:
    gen = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(8, 3, 32, 32, generator=gen), torch.randint(0, 4, (8,), generator=gen))
    return DataLoader(data, batch_size=4)


def _trainer(*callbacks: Callback) -> Trainer:
    return Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )


class _SaveWhileEnabled(Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert conv_bn_eval_enabled(pl_module.model)
        trainer.save_checkpoint(self.path)


def test_callback_trains_like_plain_and_checkpoints_load_both_ways(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plain, folded = _Classifier(), _Classifier()
    _trainer().fit(plain, _loader())
    lightning_log = logging.getLogger("lightning.pytorch")  # does not propagate to the root logger
    lightning_log.addHandler(caplog.handler)
    try:
        _trainer(ConvBNEval(only_when_cheaper=False), _SaveWhileEnabled(tmp_path / "on.ckpt")).fit(
            folded, _loader()
        )
    finally:
        lightning_log.removeHandler(caplog.handler)
    assert (
        "ConvBNEval: 20 conv-BN pairs fold while their norm uses running statistics (on every call)"
        in caplog.text
    )
    assert len(plain.losses) == 2 and plain.norm_calls == {"plain": 2 * PAIRS["resnet18"]}
    assert folded.norm_calls == {"folded": 2 * PAIRS["resnet18"]}
    assert not conv_bn_eval_enabled(folded.model)  # teardown
    for a, b in zip(plain.losses, folded.losses, strict=True):
        _assert_rel(b, a, 1e-5, "loss")
    for (name, p), q in zip(plain.named_parameters(), folded.parameters(), strict=True):
        _assert_rel(q.detach(), p.detach(), 1e-5, name)

    # saved with the callback on, loaded without it
    loaded = _Classifier()
    loaded.load_state_dict(torch.load(tmp_path / "on.ckpt", weights_only=True)["state_dict"], strict=True)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        _assert_rel(loaded.model.eval()(x), plain.model.eval()(x), 1e-5, "loaded without the callback")

    # saved without the callback, loaded into a run with it (and folded permanently for prediction)
    trainer = _trainer()
    trainer.fit(_Classifier(), _loader())
    trainer.save_checkpoint(tmp_path / "off.ckpt")
    reference = _Classifier()
    reference.load_state_dict(torch.load(tmp_path / "off.ckpt", weights_only=True)["state_dict"])
    predictor = _Classifier()
    predictions = _trainer(ConvBNEval(fold_on_predict=True)).predict(
        predictor, _loader(), ckpt_path=tmp_path / "off.ckpt"
    )
    assert not any(isinstance(m, nn.BatchNorm2d) for m in predictor.model.modules())  # folded for prediction
    with torch.no_grad():
        expected = reference.model.eval()(torch.cat([images for images, _ in _loader()]))
    _assert_rel(torch.cat(predictions), expected, 1e-5, "folded predictions")


def test_callback_picks_up_norms_replaced_after_setup() -> None:
    plain, folded = _Classifier(swap_to_frozen=True), _Classifier(swap_to_frozen=True)
    _trainer().fit(plain, _loader())
    _trainer(ConvBNEval(only_when_cheaper=False)).fit(folded, _loader())
    assert len(folded.losses) == 2 and folded.norm_calls == {"folded": 2 * PAIRS["resnet18"]}
    for a, b in zip(plain.losses, folded.losses, strict=True):
        _assert_rel(b, a, 1e-5, "loss")  # a stale fold would normalise twice


def test_callback_fails_early_without_pairs() -> None:
    module = _Classifier()
    module.model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 4))
    with pytest.raises(ValueError, match="ConvBNEval found no Conv2d -> BatchNorm2d/FrozenBatchNorm2d pair"):
        _trainer(ConvBNEval()).fit(module, _loader())


class _NormEvalCounter(Callback):
    """norm_eval for the detector (BatchNorm in eval mode before every batch), counting norm calls per
    kind.
    """

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def _count(self, module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        self.calls["folded" if output is args[0] else "plain"] += 1

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: object, i: int
    ) -> None:
        _norm_eval(pl_module.model)
        norms = [m for m in pl_module.model.modules() if isinstance(m, NORM_TYPES)]
        self._handles = [m.register_forward_hook(self._count) for m in norms]

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: object) -> None:
        for handle in self._handles:
            handle.remove()


def test_callback_on_the_maskrcnn_module(tmp_path: Path) -> None:
    cfg = compose_config([*SMOKE, "callbacks=[default,conv_bn_eval]"], tmp_path)
    callback = instantiate(cfg.callbacks.conv_bn_eval)
    assert repr(callback) == "ConvBNEval(only_when_cheaper=True, fold_on_predict=False)"
    module = instantiate(cfg.model, num_classes=4)
    gen = torch.Generator().manual_seed(0)
    masks = torch.zeros(1, 64, 64, dtype=torch.uint8)
    masks[0, 8:40, 16:48] = 1
    samples = [
        (
            torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=gen),
            {"boxes": torch.tensor([[16.0, 8.0, 48.0, 40.0]]), "labels": torch.tensor([1]), "masks": masks},
        )
        for _ in range(4)
    ]
    loader = DataLoader(samples, batch_size=2, collate_fn=lambda batch: tuple(zip(*batch)))
    counter = _NormEvalCounter()
    trainer = Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, counter],
    )
    trainer.fit(module, loader)
    pairs = find_conv_norm_pairs(module.model)
    assert len(pairs) == 12 and pairs[0] == ("backbone.body.conv1", "backbone.body.bn1")
    # 2 images of 64 px: only the stem's and layer2's downsample outputs outweigh their conv weights
    assert counter.calls == {"folded": 2 * 2, "plain": 2 * 10}
    assert not conv_bn_eval_enabled(module.model)
    with pytest.raises(ValueError, match="^only_when_cheaper='yes' must be true or false"):
        ConvBNEval(only_when_cheaper="yes")  # type: ignore[arg-type]

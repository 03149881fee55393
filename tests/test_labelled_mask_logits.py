"""``model.labelled_mask_logits``: the mask loss from each RoI's own-class logits only, against the full logits."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from torch import nn
from torchvision.models.detection.mask_rcnn import MaskRCNNPredictor

from lit_amp_det.models.labelled_mask_logits import labelled_logits, logit_conv
from lit_amp_det.models.patch_deconv import use_patch_deconv

from conftest import compose_config


def _predictor(classes: int = 7, channels: int = 16, bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    predictor = MaskRCNNPredictor(channels, channels, classes)
    if not bias:
        predictor.mask_fcn_logits = nn.Conv2d(channels, classes, 1, bias=False)
    return predictor


def _inputs(k: int = 5, channels: int = 16, size: int = 14, classes: int = 7, channels_last: bool = False):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(k, channels, size, size, generator=gen)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randint(1, classes, (k,), generator=gen)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_equals_the_full_logits_and_their_gradients(channels_last: bool, bias: bool) -> None:
    full_predictor = _predictor(bias=bias)
    ours_predictor = _predictor(bias=bias)
    if channels_last:
        full_predictor.to(memory_format=torch.channels_last)
        ours_predictor.to(memory_format=torch.channels_last)
    x, labels = _inputs(channels_last=channels_last)
    x_full, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    full = full_predictor(x_full)[torch.arange(len(labels)), labels]
    ours = labelled_logits(ours_predictor, x_ours, labels)
    assert ours.shape == full.shape == (5, 28, 28) and ours.dtype == full.dtype
    torch.testing.assert_close(ours, full, rtol=1e-5, atol=1e-5)
    weight = torch.randn_like(full)
    (full * weight).sum().backward()
    (ours * weight).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_full.grad, rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(full_predictor.named_parameters(), ours_predictor.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-5, msg=name)  # untouched rows: zero in both


def test_float64_gradcheck() -> None:
    predictor = _predictor(channels=4).double()
    x, labels = _inputs(k=3, channels=4, size=3)
    x = x.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: labelled_logits(predictor, t, labels), (x,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_and_with_half_weights(dtype: torch.dtype) -> None:
    """The dtype (and closeness) of the convolution's own logits: autocast's dtype, or the half weights'."""
    predictor = _predictor()
    x, labels = _inputs()
    with torch.autocast("cpu", dtype=dtype):
        full = predictor(x)[torch.arange(5), labels]
        ours = labelled_logits(predictor, x, labels)
    assert ours.dtype == full.dtype == dtype
    torch.testing.assert_close(ours.float(), full.float(), rtol=2e-2, atol=2e-2)
    half = _predictor().to(dtype)
    full, ours = half(x.to(dtype))[torch.arange(5), labels], labelled_logits(half, x.to(dtype), labels)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), full.float(), rtol=2e-2, atol=2e-2)


def test_no_rois_and_other_predictors() -> None:
    predictor = _predictor()
    x, labels = _inputs(k=0)
    out = labelled_logits(predictor, x.requires_grad_(), labels)
    assert out.shape == (0, 28, 28)
    out.sum().backward()  # the graph reaches the parameters (DDP needs every one used)
    assert predictor.mask_fcn_logits.weight.grad is not None
    assert labelled_logits(nn.Sequential(nn.Conv2d(16, 7, 1)), x, labels) is None

    class Custom(MaskRCNNPredictor):
        def forward(self, x):
            return super().forward(x) * 2

    assert logit_conv(Custom(16, 16, 7)) is None
    deconv = _predictor()
    assert use_patch_deconv(deconv) == 1 and logit_conv(deconv) is deconv.mask_fcn_logits  # the upsampling may change


def _module(tmp_path: Path, *overrides: str):
    cfg = compose_config(["experiment=smoke", *overrides], tmp_path)
    torch.manual_seed(0)
    return instantiate(cfg.model, _convert_="all", num_classes=4)


def test_the_module_loss_is_the_full_logits_loss(tmp_path: Path) -> None:
    from test_low_precision_weights import _batch

    images, targets = _batch()
    losses = {}
    for flag in (False, True):
        module = _module(tmp_path, f"model.labelled_mask_logits={str(flag).lower()}")
        assert module.model.roi_heads.labelled_mask_logits is flag
        module.train()
        torch.manual_seed(3)
        out = module.model(module.prepare_images(images), module.training_targets(targets))
        losses[flag] = out["loss_mask"]
    assert losses[True] > 0
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=1e-6)


def test_the_module_warns_when_nothing_switches(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        module = _module(tmp_path, "model.labelled_mask_logits=true", "model.ops=torchvision")
    assert "applies to Mask R-CNN with model.ops=ext" in caplog.text
    assert not getattr(module.model.roi_heads, "labelled_mask_logits", False)


def test_precision_regions_on_the_predictor() -> None:
    """An fp32_outputs region (the default) is reproduced by the loss's fp32 cast; an fp32 one keeps the full path."""
    from lit_amp_det.precision.casting import unwrap_method, wrap_method

    predictor = _predictor()
    wrap_method(predictor, "forward", "fp32_outputs")
    assert logit_conv(predictor) is predictor.mask_fcn_logits
    unwrap_method(predictor, "forward")
    wrap_method(predictor, "forward", "fp32")
    assert logit_conv(predictor) is None
    x, labels = _inputs()
    assert labelled_logits(predictor, x, labels) is None


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("mode", ["autocast", "half-weights", "master-weights"])
def test_matmul_upsampling_runs_on_its_patches(channels_last: bool, mode: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With the matmul upsampling in bf16 the logits come from its patch-ordered product (the module's forward is
    not called) and equal the full predictor's, values and gradients, to bf16 rounding. ``master-weights`` is the
    ``bf16-weights`` precision's conversion, whose input-cast pre-hooks (fp32 features in) the patch path applies."""
    from lit_amp_det.models.patch_deconv import PatchConvTranspose2d
    from lit_amp_det.precision.master_weights import use_low_precision_weights

    dtype = torch.bfloat16
    format_ = torch.channels_last if channels_last else torch.contiguous_format
    predictors = []
    for _ in range(2):
        predictor = _predictor()
        assert use_patch_deconv(predictor) == 1
        if mode == "half-weights":
            predictor.to(dtype)
        elif mode == "master-weights":
            use_low_precision_weights(predictor, dtype)
            assert predictor[0]._forward_pre_hooks  # the hook the patch path must see through
        predictors.append(predictor.to(memory_format=format_))
    full_predictor, ours_predictor = predictors
    x, labels = _inputs(channels_last=channels_last)
    x = x.to(dtype) if mode == "half-weights" else x
    x_full, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype, enabled=mode == "autocast"):
        full = full_predictor(x_full)[torch.arange(len(labels)), labels]
        with monkeypatch.context() as patch:
            patch.setattr(PatchConvTranspose2d, "forward", lambda *a, **k: pytest.fail("the module ran"))
            ours = labelled_logits(ours_predictor, x_ours, labels)
    assert ours.dtype == full.dtype == dtype and ours.shape == full.shape
    torch.testing.assert_close(ours.float(), full.float(), rtol=2e-2, atol=2e-2)
    weight = torch.randn(full.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    (full * weight).float().sum().backward()
    (ours * weight).float().sum().backward()
    torch.testing.assert_close(x_ours.grad.float(), x_full.grad.float(), rtol=3e-2, atol=3e-2)
    for (name, a), b in zip(full_predictor.named_parameters(), ours_predictor.parameters()):
        scale = a.grad.abs().max().float().clamp(min=1)
        torch.testing.assert_close(b.grad.float() / scale, a.grad.float() / scale, rtol=0, atol=3e-2, msg=name)


def test_hooks_keep_the_modules_path() -> None:
    predictor = _predictor()
    use_patch_deconv(predictor)
    calls = []
    predictor[0].register_forward_hook(lambda *args: calls.append("upsample"))
    x, labels = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        labelled_logits(predictor, x, labels)
    assert calls == ["upsample"]

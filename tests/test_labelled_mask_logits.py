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


# --- inference: each detection's predicted class's map only ---------------------------------------------------------

def _detect(module, images, *, dtype: torch.dtype | None = None) -> tuple[list[dict[str, torch.Tensor]], int]:
    """The RoI heads' detections in ``module.model``'s eval forward (masks: ``[D, 1, 28, 28]`` probabilities, before
    pasting), and how often the logit convolution itself ran."""
    calls, detections = [], []
    roi_heads = module.model.roi_heads
    handles = [roi_heads.mask_predictor.mask_fcn_logits.register_forward_hook(lambda *args: calls.append(1)),
               roi_heads.register_forward_hook(  # copies: the transform pastes the masks into these dicts
                   lambda _module, _args, out: detections.append([dict(d) for d in out[0]]))]
    try:
        with torch.inference_mode(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            module.model(module.prepare_images(images))
    finally:
        for handle in handles:
            handle.remove()
    return detections[0], len(calls)


def _eval_modules(tmp_path: Path, *overrides: str, score_thresh: float = 0.0):
    """The same weights with and without ``labelled_mask_logits``, in eval mode; a score threshold of 0 makes the
    untrained model detect up to ``detections_per_img`` objects per image."""
    modules = []
    for flag in (False, True):
        module = _module(tmp_path, f"model.labelled_mask_logits={str(flag).lower()}",
                         f"model.roi_heads.score_thresh={score_thresh}", *overrides)
        modules.append(module.eval())
    return modules


def _assert_same_detections(ours, full, *, rtol: float, atol: float) -> None:
    assert len(ours) == len(full)
    for o, f in zip(ours, full):
        assert o.keys() == f.keys() == {"boxes", "labels", "scores", "masks"}
        for key in ("boxes", "labels", "scores"):
            torch.testing.assert_close(o[key], f[key], rtol=0, atol=0, msg=key)  # the box head is untouched
        assert o["masks"].dtype == f["masks"].dtype and o["masks"].shape == f["masks"].shape
        torch.testing.assert_close(o["masks"].float(), f["masks"].float(), rtol=rtol, atol=atol)


def test_inference_equals_torchvisions_masks(tmp_path: Path) -> None:
    """fp32: the masks of torchvision's ``maskrcnn_inference`` (every class's map, the detection's kept) from the
    detections' own-class logits, without running the logit convolution."""
    from test_low_precision_weights import _batch

    images, _ = _batch()
    full_module, ours_module = _eval_modules(tmp_path)
    full, full_calls = _detect(full_module, images)
    ours, ours_calls = _detect(ours_module, images)
    assert full_calls == 1 and ours_calls == 0
    assert sum(len(d["labels"]) for d in full) == 100  # 50 a picture: the masks of many classes are compared
    assert len(set(torch.cat([d["labels"] for d in full]).tolist())) > 1
    _assert_same_detections(ours, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("regions", [True, False], ids=["fp32-outputs-region", "plain-autocast"])
@pytest.mark.parametrize("deconv_as_matmul", [False, True], ids=["deconv", "matmul-upsampling"])
def test_inference_under_autocast(tmp_path: Path, regions: bool, deconv_as_matmul: bool) -> None:
    """bf16 autocast: with the default fp32_outputs region on the predictor the probabilities come out in fp32, as
    the region's cast logits give them; without it in bf16, as torchvision's sigmoid of bf16 logits. The matmul
    upsampling's patch path runs at inference too."""
    from lit_amp_det.precision.casting import set_mixed_precision, wrap_method
    from test_low_precision_weights import _batch

    images, _ = _batch()
    modules = _eval_modules(tmp_path, f"model.deconv_as_matmul={str(deconv_as_matmul).lower()}",
                            "model.channels_last=true")
    results = []
    for module in modules:
        if regions:  # as the precision plugin puts it: the region, and mixed precision on for its owner
            wrap_method(module.model.roi_heads.mask_predictor, "forward", "fp32_outputs")
            set_mixed_precision(module.model.roi_heads.mask_predictor, torch.bfloat16)
        results.append(_detect(module, images, dtype=torch.bfloat16))
    (full, full_calls), (ours, ours_calls) = results
    assert full_calls == 1 and ours_calls == 0
    assert full[0]["masks"].dtype == (torch.float32 if regions else torch.bfloat16)
    _assert_same_detections(ours, full, rtol=0, atol=3e-2)  # probabilities in [0, 1], bf16 logits


def test_inference_without_detections_and_with_other_predictors(tmp_path: Path) -> None:
    """No detection gives torchvision's empty ``[0, 1, H, W]`` masks; a predictor the own-class path cannot
    reproduce (an ``fp32`` region asks for the convolution itself in fp32) takes torchvision's path."""
    from lit_amp_det.precision.casting import set_mixed_precision, wrap_method
    from test_low_precision_weights import _batch

    images, _ = _batch()
    full_module, ours_module = _eval_modules(tmp_path, score_thresh=1.0)
    (full, _), (ours, ours_calls) = _detect(full_module, images), _detect(ours_module, images)
    assert ours_calls == 0 and [d["masks"].shape for d in ours] == [d["masks"].shape for d in full] == [
        (0, 1, 28, 28)] * 2
    _assert_same_detections(ours, full, rtol=0, atol=0)
    full_module, ours_module = _eval_modules(tmp_path)
    for module in (full_module, ours_module):
        wrap_method(module.model.roi_heads.mask_predictor, "forward", "fp32")
        set_mixed_precision(module.model.roi_heads.mask_predictor, torch.bfloat16)
    (full, _), (ours, ours_calls) = _detect(full_module, images, dtype=torch.bfloat16), _detect(
        ours_module, images, dtype=torch.bfloat16)
    assert ours_calls == 1
    _assert_same_detections(ours, full, rtol=0, atol=0)


def test_inference_checks_targets_as_torchvision_does(tmp_path: Path) -> None:
    from test_low_precision_weights import _batch

    images, targets = _batch()
    _, module = _eval_modules(tmp_path)
    targets[0]["labels"] = targets[0]["labels"].int()
    with pytest.raises(TypeError, match="target labels must of int64 type"):
        module.model(module.prepare_images(images), targets)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-weights"])
def test_inference_under_the_precision_plugin(tmp_path: Path, precision: str) -> None:
    """The plugin's default regions (the predictor's fp32_outputs) with autocast or bf16 weights: fp32
    probabilities from the own-class logits, close to the full path's."""
    from lit_amp_det.models.labelled_mask_logits import casts_outputs_to_fp32
    from lit_amp_det.precision import build_precision_plugin
    from test_low_precision_weights import _batch

    images, _ = _batch()
    results = []
    for module in _eval_modules(tmp_path, "model.deconv_as_matmul=true"):
        plugin = build_precision_plugin(precision, "cpu", fp32_regions=module.fp32_regions())
        module = plugin.convert_module(module)
        assert casts_outputs_to_fp32(module.model.roi_heads.mask_predictor)
        with plugin.forward_context():
            results.append(_detect(module, images))
    (full, full_calls), (ours, ours_calls) = results
    assert full_calls == 1 and ours_calls == 0 and full[0]["masks"].dtype == torch.float32
    _assert_same_detections(ours, full, rtol=0, atol=3e-2)

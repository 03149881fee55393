"""model.deconv_as_matmul: a patchwise ConvTranspose2d as one matmul equals torch's transposed convolution.

Checked against ``F.conv_transpose2d`` (float64 reference and the same dtype), in fp32/fp16/bf16, NCHW and
channels_last, with and without bias, square and rectangular kernels, the R50-FPN mask head's real size, empty
batches, and gradients (gradcheck in float64); then the module's dispatch and the model-level switch.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_config
from hydra.utils import instantiate
from torch import nn

from lit_amp_det.models import patch_deconv
from lit_amp_det.models.patch_deconv import PatchConvTranspose2d, is_patchwise, patch_conv_transpose2d, use_patch_deconv
from lit_amp_det.precision.hardware import cpu_computes_bf16_natively

#: (dtype, atol, rtol) against the float64 reference: the half dtypes round their inputs and output
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 1e-2), torch.bfloat16: (1.5e-1, 2e-2)}


def _inputs(n: int, c_in: int, c_out: int, size: tuple[int, int], kernel: tuple[int, int], dtype: torch.dtype,
            channels_last: bool, bias: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, c_in, *size, generator=gen).to(dtype)
    w = (torch.randn(c_in, c_out, *kernel, generator=gen) / c_in ** 0.5).to(dtype)
    b = torch.randn(c_out, generator=gen).to(dtype) if bias else None
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, w, b


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.conv_transpose2d(x.double(), w.double(), None if b is None else b.double(), stride=w.shape[2:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("kernel", [(2, 2), (3, 3), (2, 3), (1, 1)], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_matches_conv_transpose2d(dtype: torch.dtype, channels_last: bool, kernel: tuple[int, int],
                                  bias: bool) -> None:
    x, w, b = _inputs(3, 16, 12, (5, 7), kernel, dtype, channels_last, bias)
    out = patch_conv_transpose2d(x, w, b)
    assert out.dtype == dtype and out.shape == (3, 12, 5 * kernel[0], 7 * kernel[1])
    assert out.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), _reference(x, w, b), atol=atol, rtol=rtol)
    if dtype != torch.float16:  # torch has no fp16 transposed convolution on a CPU
        torch.testing.assert_close(out, F.conv_transpose2d(x, w, b, stride=kernel), atol=atol, rtol=rtol)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_mask_head_size_in_bf16_equals_onednn(channels_last: bool) -> None:
    """The R50-FPN mask head's layer at its real size (70 RoIs, 256 channels, 14 -> 28): forward and all three
    gradients within bf16 rounding of a float64 transposed convolution, and, where torch's bf16 kernel is oneDNN's
    (a CPU with native bf16), within 2 % of it. Elsewhere torch's bf16 weight gradient accumulates in bf16 (2.2 % of
    its largest value off float64 on an AVX2 CPU, where ours stays at 0.34 %), so it is no reference there."""
    x, w, b = _inputs(70, 256, 256, (14, 14), (2, 2), torch.bfloat16, channels_last)
    grad = torch.randn(70, 256, 28, 28, generator=torch.Generator().manual_seed(1)).bfloat16()
    results = []
    for fn, dtype in ((patch_conv_transpose2d, torch.bfloat16),
                      (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), torch.bfloat16),
                      (lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), torch.float64)):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, w, b)]
        out = fn(*leaves)
        out.backward(grad.to(dtype))
        results.append((out.double(), *(t.grad.double() for t in leaves)))
    native_is_onednn = cpu_computes_bf16_natively()
    for name, ours, native, exact in zip(("output", "input grad", "weight grad", "bias grad"), *results):
        scale = exact.abs().max().item()
        assert (ours - exact).abs().max().item() <= 0.01 * scale, name
        if native_is_onednn:
            assert (ours - native).abs().max().item() <= 0.02 * native.abs().max().item(), name


def test_gradcheck_float64() -> None:
    x, w, b = (t.requires_grad_(True) for t in _inputs(2, 3, 4, (3, 2), (2, 3), torch.float64, True))
    assert torch.autograd.gradcheck(patch_conv_transpose2d, (x, w, b))
    x2, w2, _ = _inputs(2, 3, 4, (2, 2), (2, 2), torch.float64, False, bias=False)
    assert torch.autograd.gradcheck(patch_conv_transpose2d, (x2.requires_grad_(True), w2.requires_grad_(True), None))


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_gradgradcheck_float64(channels_last: bool) -> None:
    x, w, b = (t.requires_grad_(True) for t in _inputs(1, 2, 3, (2, 2), (2, 2), torch.float64, channels_last))
    assert torch.autograd.gradgradcheck(patch_conv_transpose2d, (x, w, b))


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_output_is_not_a_view_so_an_inplace_relu_is_cheap_and_correct(channels_last: bool) -> None:
    """The mask head's ReLU is in place. On a view it would route the backward through as_strided (a zero-filled
    copy of the map); the output is a tensor of its own, and the gradients equal the out-of-place ReLU's."""
    x, w, b = _inputs(2, 4, 3, (3, 3), (2, 2), torch.float32, channels_last)
    grads = []
    for inplace in (False, True):
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
        out = patch_conv_transpose2d(*leaves)
        assert out._base is None
        out = torch.relu_(out) if inplace else torch.relu(out)
        assert "AsStrided" not in type(out.grad_fn).__name__ and "CopySlices" not in type(out.grad_fn).__name__
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        grads.append([t.grad for t in leaves])
    for expected, actual in zip(*grads):
        torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_empty_batch_forward_and_backward(channels_last: bool) -> None:
    """No positive RoI in a step: an empty batch gives an empty output and zero weight and bias gradients."""
    x, w, b = _inputs(0, 8, 4, (14, 14), (2, 2), torch.bfloat16, channels_last)
    w.requires_grad_(True), b.requires_grad_(True)
    out = patch_conv_transpose2d(x, w, b)
    assert out.shape == (0, 4, 28, 28)
    out.sum().backward()
    assert torch.count_nonzero(w.grad) == 0 and torch.count_nonzero(b.grad) == 0


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = patch_deconv.patch_conv_transpose2d
    monkeypatch.setattr(patch_deconv, "patch_conv_transpose2d", lambda *a: calls.append(1) or real(*a))
    return calls


def _layer(**kwargs: object) -> nn.ConvTranspose2d:
    torch.manual_seed(0)
    return nn.ConvTranspose2d(8, 6, **{"kernel_size": 2, "stride": 2, **kwargs})


def test_layer_takes_the_matmul_in_half_precision_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU outside FP32_MATMUL_CAPABILITIES: bf16 input, or fp32 input under bf16 autocast: the matmul. fp32,
    an explicit output_size and an unbatched input: torch's own layer, with its own result."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    calls = _spy(monkeypatch)
    native = _layer()
    layer = _layer()
    assert use_patch_deconv(layer) == 1 and type(layer) is PatchConvTranspose2d
    x = torch.randn(2, 8, 5, 5)

    torch.testing.assert_close(layer(x), native(x), rtol=0, atol=0)  # fp32: the native layer, bit for bit
    assert layer(x, output_size=[10, 10]).shape == (2, 6, 10, 10)
    assert layer(x[0]).shape == (6, 10, 10)
    assert calls == []

    layer.bfloat16(), native.bfloat16()
    torch.testing.assert_close(layer(x.bfloat16()), native(x.bfloat16()), atol=2e-2, rtol=2e-2)
    assert len(calls) == 1
    layer.float(), native.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = layer(x), native(x)
    assert out.dtype == expected.dtype == torch.bfloat16 and len(calls) == 2
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)


def test_layer_takes_the_matmul_in_float32_on_an_avx2_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an AVX2 CPU (FP32_MATMUL_CAPABILITIES, where the fp32 step measured faster with it) fp32 input takes the
    matmul too, with the native layer's values to fp32 rounding; float64, an explicit output_size and an unbatched
    input still run torch's own layer."""
    from lit_amp_det.models.patch_deconv import FP32_MATMUL_CAPABILITIES

    assert FP32_MATMUL_CAPABILITIES == {"AVX2"}
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    calls = _spy(monkeypatch)
    native, layer = _layer(), _layer()
    use_patch_deconv(layer)
    x = torch.randn(2, 8, 5, 5)
    assert layer.computes_as_matmul(x)
    torch.testing.assert_close(layer(x), native(x), rtol=1e-5, atol=1e-6)
    assert len(calls) == 1
    assert layer(x, output_size=[10, 10]).shape == (2, 6, 10, 10) and layer(x[0]).shape == (6, 10, 10)
    layer.double(), native.double()
    torch.testing.assert_close(layer(x.double()), native(x.double()), rtol=0, atol=0)
    assert len(calls) == 1


@pytest.mark.parametrize("kwargs", [dict(kernel_size=3, stride=2), dict(padding=1), dict(output_padding=1),
                                    dict(dilation=2), dict(groups=2)], ids=str)
def test_overlapping_or_padded_layers_are_left_alone(kwargs: dict[str, int]) -> None:
    layer = _layer(**kwargs)
    assert not is_patchwise(layer)
    assert use_patch_deconv(nn.Sequential(layer)) == 0 and type(layer) is nn.ConvTranspose2d


def test_subclasses_are_left_alone() -> None:
    class Custom(nn.ConvTranspose2d):
        pass

    layer = Custom(4, 4, 2, stride=2)
    assert use_patch_deconv(layer) == 0 and type(layer) is Custom


def _module(**overrides: object) -> nn.Module:
    cfg = compose_config(["experiment=smoke"])
    torch.manual_seed(0)
    return instantiate(cfg.model, _convert_="all", num_classes=4, **overrides)


def _training_losses(module: nn.Module) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    images = [torch.rand(3, 64, 64, generator=gen) for _ in range(2)]
    masks = torch.zeros(2, 64, 64, dtype=torch.uint8)
    masks[0, 8:40, 8:40] = 1
    masks[1, 30:60, 20:50] = 1
    targets = [{"boxes": torch.tensor([[8.0, 8.0, 40.0, 40.0], [20.0, 30.0, 50.0, 60.0]]),
                "labels": torch.tensor([1, 2]), "masks": masks} for _ in images]
    module.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(2)  # the samplers' draws
        return module.model(images, targets)


def test_model_switch_keeps_state_dict_and_losses() -> None:
    plain, switched = _module(), _module(deconv_as_matmul=True)
    assert type(switched.model.roi_heads.mask_predictor.conv5_mask) is PatchConvTranspose2d
    assert type(plain.model.roi_heads.mask_predictor.conv5_mask) is nn.ConvTranspose2d
    assert list(switched.state_dict()) == list(plain.state_dict())
    switched.load_state_dict(plain.state_dict())
    expected, actual = _training_losses(plain), _training_losses(switched)
    assert expected.keys() == actual.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=1e-2, rtol=1e-2)
    actual["loss_mask"].backward()
    assert switched.model.roi_heads.mask_predictor.conv5_mask.weight.grad is not None


def test_faster_rcnn_has_nothing_to_switch_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lit_amp_det.module"):
        _module(mask=False, deconv_as_matmul=True)
    assert "nothing was switched" in caplog.text


def test_config_default_is_off() -> None:
    assert compose_config(["experiment=smoke"]).model.deconv_as_matmul is False

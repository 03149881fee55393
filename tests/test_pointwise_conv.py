"""model.pointwise_conv_as_matmul: a 1x1 Conv2d on an NHWC map as matrix products equals torch's convolution.

Checked against ``F.conv2d`` (float64 reference and the same dtype), in fp32/fp16/bf16, with and without bias, strides
1 and 2 on odd sizes, the R50-FPN's real layer4 and FPN sizes, empty batches, gradients (gradcheck and gradgradcheck in
float64), autocast; then the layer's dispatch, conv-BN eval folding through it, and the model-level switch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_config
from hydra.utils import instantiate
from torch import nn

from lit_amp_det.models.conv_bn import enable_conv_bn_eval, find_conv_norm_pairs
from lit_amp_det.models.pointwise_conv import PointwiseConv2d, is_pointwise, pointwise_conv2d, use_pointwise_matmul

#: (dtype, atol, rtol) against the float64 reference: the half dtypes round their inputs and output
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 1e-2), torch.bfloat16: (1.5e-1, 2e-2)}
NHWC = torch.channels_last


def _inputs(n: int, c_in: int, c_out: int, size: tuple[int, int], dtype: torch.dtype,
            bias: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, c_in, *size, generator=gen).to(dtype).contiguous(memory_format=NHWC)
    w = (torch.randn(c_out, c_in, 1, 1, generator=gen) / c_in ** 0.5).to(dtype)
    b = torch.randn(c_out, generator=gen).to(dtype) if bias else None
    return x, w, b


def _grads(fn, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, grad: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
    out = fn(*leaves, *([None] if b is None else []))
    return [out, *torch.autograd.grad(out, leaves, grad)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("stride", [1, 2, (2, 1)], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_matches_conv2d(dtype: torch.dtype, stride: int | tuple[int, int], bias: bool) -> None:
    x, w, b = _inputs(3, 16, 12, (5, 7), dtype, bias)
    out = pointwise_conv2d(x, w, b, stride)
    expected_shape = F.conv2d(x.double(), w.double(), stride=stride).shape
    assert out.dtype == dtype and out.shape == expected_shape
    assert out.is_contiguous(memory_format=NHWC) and out._base is None
    atol, rtol = TOLERANCE[dtype]
    reference = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride)
    torch.testing.assert_close(out.double(), reference, atol=atol, rtol=rtol)
    if dtype != torch.float16:  # torch has no fp16 convolution on a CPU
        torch.testing.assert_close(out, F.conv2d(x, w, b, stride), atol=atol, rtol=rtol)


@pytest.mark.parametrize("stride", [1, 2, (1, 3)], ids=str)
def test_gradients_match_conv2d_in_float64(stride: int | tuple[int, int]) -> None:
    x, w, b = _inputs(2, 8, 6, (5, 7), torch.float64)
    grad = torch.randn(F.conv2d(x, w, b, stride).shape, dtype=torch.float64).contiguous(memory_format=NHWC)
    ours = _grads(lambda x, w, b: pointwise_conv2d(x, w, b, stride), x, w, b, grad)
    theirs = _grads(lambda x, w, b: F.conv2d(x, w, b, stride), x, w, b, grad)
    for a, e in zip(ours, theirs):
        torch.testing.assert_close(a, e)
    assert ours[1].is_contiguous(memory_format=NHWC)  # the input gradient keeps the layout


@pytest.mark.parametrize("stride", [1, 2], ids=str)
def test_gradcheck_and_gradgradcheck_float64(stride: int) -> None:
    x, w, b = (t.requires_grad_() for t in _inputs(2, 4, 3, (3, 5), torch.float64))
    assert torch.autograd.gradcheck(lambda *a: pointwise_conv2d(*a, stride), (x, w, b))
    assert torch.autograd.gradgradcheck(lambda *a: pointwise_conv2d(*a, stride), (x, w, b))


@pytest.mark.parametrize("shape", [(2048, 512, 8, 1), (2048, 256, 8, 1), (1024, 2048, 16, 2)], ids=str)
def test_r50_sizes_in_bf16_agree_with_onednn(shape: tuple[int, int, int, int]) -> None:
    """ResNet-50 layer4's reduction, the FPN's top lateral and layer4's stride-2 shortcut at 256 px, batch 2: output
    and all three gradients agree with torch's bf16 convolution to bf16 rounding of differently ordered sums."""
    c_in, c_out, size, stride = shape
    x, w, b = _inputs(2, c_in, c_out, (size, size), torch.bfloat16)
    grad = torch.randn(F.conv2d(x, w, b, stride).shape).to(torch.bfloat16).contiguous(memory_format=NHWC)
    ours = _grads(lambda x, w, b: pointwise_conv2d(x, w, b, stride), x, w, b, grad)
    theirs = _grads(lambda x, w, b: F.conv2d(x, w, b, stride), x, w, b, grad)
    for a, e in zip(ours, theirs):
        scale = e.float().abs().max().item()
        torch.testing.assert_close(a.float(), e.float(), atol=2e-2 * scale, rtol=2e-2)


def test_output_is_not_a_view_so_inplace_ops_stay_cheap_and_correct() -> None:
    """The ResNet block adds the shortcut in place and applies an in-place ReLU to the conv output."""
    x, w, _ = _inputs(2, 8, 8, (4, 4), torch.float64)
    grad = torch.randn(2, 8, 4, 4, dtype=torch.float64)

    def block(conv):
        def run(x, w, b):
            out = conv(x, w, b)
            out += x
            return torch.relu_(out)
        return run

    ours = _grads(block(pointwise_conv2d), x, w, None, grad)
    theirs = _grads(block(F.conv2d), x, w, None, grad)
    for a, e in zip(ours, theirs):
        torch.testing.assert_close(a, e)
    out = pointwise_conv2d(x.requires_grad_(), w)
    out += 1
    assert "AsStrided" not in type(out.grad_fn).__name__ and "CopySlices" not in type(out.grad_fn).__name__


@pytest.mark.parametrize("stride", [1, 2], ids=str)
def test_empty_batch_forward_and_backward(stride: int) -> None:
    x, w, b = (t.requires_grad_() for t in _inputs(0, 8, 4, (5, 5), torch.float32))
    out = pointwise_conv2d(x, w, b, stride)
    assert out.shape == (0, 4, 3 if stride == 2 else 5, 3 if stride == 2 else 5)
    gx, gw, gb = torch.autograd.grad(out.sum(), (x, w, b))
    assert gx.shape == x.shape and not gw.any() and not gb.any()


def test_autocast_casts_like_conv2d_and_keeps_fp32_weight_gradients() -> None:
    x, w, b = _inputs(2, 16, 8, (4, 4), torch.float32)
    w.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = pointwise_conv2d(x, w, b)
        theirs = F.conv2d(x, w, b)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    torch.testing.assert_close(ours, theirs, atol=3e-2, rtol=2e-2)
    (grad,) = torch.autograd.grad(ours.float().sum(), w)
    assert grad.dtype == torch.float32


def test_bad_inputs_say_what_is_wrong() -> None:
    x, w, _ = _inputs(1, 4, 2, (3, 3), torch.float32)
    with pytest.raises(ValueError, match="channels_last input"):
        pointwise_conv2d(x.contiguous(), w)
    with pytest.raises(ValueError, match=r"weight \[C_out, C_in, 1, 1\].*\(2, 4, 3, 3\)"):
        pointwise_conv2d(x, torch.zeros(2, 4, 3, 3))


def test_layer_takes_the_matmul_in_half_precision_on_nhwc_only(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = nn.Conv2d(8, 4, 1)
    layer.__class__ = PointwiseConv2d
    calls = []
    monkeypatch.setattr("lit_amp_det.models.pointwise_conv.pointwise_conv2d",
                        lambda *a: calls.append(a) or F.conv2d(a[0], a[1], a[2], a[3]))
    x = torch.randn(2, 8, 3, 3)
    layer(x.contiguous(memory_format=NHWC))  # fp32: oneDNN's convolution wins
    layer.bfloat16()
    layer(x.bfloat16())  # NCHW: the matmul would copy the input
    assert not calls
    layer(x.bfloat16().contiguous(memory_format=NHWC))
    layer.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x.contiguous(memory_format=NHWC))
    assert len(calls) == 2
    reference = nn.Conv2d(8, 4, 1).bfloat16()
    reference.load_state_dict(layer.bfloat16().state_dict())
    xb = x.bfloat16().contiguous(memory_format=NHWC)
    torch.testing.assert_close(layer(xb), reference(xb))


@pytest.mark.parametrize("kwargs", [{"kernel_size": 3}, {"kernel_size": 1, "padding": 1},
                                    {"kernel_size": 1, "groups": 2}], ids=str)
def test_other_geometries_are_not_pointwise(kwargs: dict[str, int]) -> None:
    assert not is_pointwise(nn.Conv2d(4, 4, **kwargs))


def _tiny_detector_module(**model_overrides: object):
    overrides = [f"model.{k}={str(v).lower()}" for k, v in model_overrides.items()]
    cfg = compose_config(["model=maskrcnn_tiny", "model.num_classes=3", *overrides])
    return instantiate(cfg.model, _convert_="object")


def test_model_switch_covers_the_backbone_keeps_state_dict_and_conv_bn_pairs() -> None:
    plain = _tiny_detector_module(channels_last=True)
    switched = _tiny_detector_module(channels_last=True, pointwise_conv_as_matmul=True)
    backbone = switched.model.backbone
    pointwise = [m for m in backbone.modules() if isinstance(m, PointwiseConv2d)]
    assert pointwise and all(is_pointwise(m) for m in pointwise)
    assert not any(isinstance(m, PointwiseConv2d) for m in switched.model.rpn.modules())
    assert not any(isinstance(m, PointwiseConv2d) for m in switched.model.roi_heads.modules())
    assert [type(m) for m in backbone.modules() if isinstance(m, nn.Conv2d) and not is_pointwise(m)] == \
        [type(m) for m in plain.model.backbone.modules() if isinstance(m, nn.Conv2d) and not is_pointwise(m)]
    assert list(switched.state_dict()) == list(plain.state_dict())
    assert find_conv_norm_pairs(switched.model) == find_conv_norm_pairs(plain.model)


def test_switched_backbone_equals_the_plain_one_with_conv_bn_eval_in_bf16() -> None:
    """The same weights through the plain and the switched backbone, norms in eval mode and every pair folded
    (the folded weight goes through :meth:`PointwiseConv2d.convolve`): features and weight gradients agree."""
    plain = _tiny_detector_module(channels_last=True).model.backbone
    switched = _tiny_detector_module(channels_last=True, pointwise_conv_as_matmul=True).model.backbone
    switched.load_state_dict(plain.state_dict())
    for net in (plain, switched):
        net.bfloat16().eval()
        assert enable_conv_bn_eval(net, only_when_cheaper=False)
    x = torch.randn(2, 3, 64, 64).bfloat16().contiguous(memory_format=NHWC)
    outs = [net(x) for net in (plain, switched)]
    for key in outs[0]:
        torch.testing.assert_close(outs[1][key].float(), outs[0][key].float(), atol=5e-2, rtol=5e-2)
    for net, out in zip((plain, switched), outs):
        sum(o.float().square().mean() for o in out.values()).backward()
    grads = [{n: p.grad.float() for n, p in net.named_parameters() if p.grad is not None} for net in (plain, switched)]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        scale = grads[0][name].abs().max().item() + 1e-6
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=5e-2 * scale, rtol=5e-2, msg=name)


def test_switch_needs_a_backbone() -> None:
    with pytest.raises(TypeError, match="pointwise_conv_as_matmul=true needs a detector with a .backbone"):
        use_pointwise_matmul(nn.Sequential(nn.Conv2d(2, 2, 1)))


def test_config_default_is_off() -> None:
    assert compose_config([]).model.pointwise_conv_as_matmul is False

"""RoIAlign, multi-level RoIAlign and MultiScaleRoIAlign: parity with torchvision and the float64 reference,
mixed precision, channels_last, gradients, opcheck and compile.
"""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import Tensor

import lit_amp_det.ops as ops
from lit_amp_det.ops import reference
from ops_inputs import DEVICES, assert_as_close_as_theirs, needs_extension, random_boxes, random_rois

pytestmark = needs_extension

#: absolute tolerance of a pooled value (features ~ N(0, 1)) per input dtype
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
LAYOUTS = [torch.contiguous_format, torch.channels_last]


def _features(shape, dtype, layout, device="cpu", seed=0) -> Tensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x.to(device=device, dtype=dtype).contiguous(memory_format=layout)


def _working_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the kernels compute in: fp32 for fp16/bf16/fp32 inputs, fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _torchvision(x: Tensor, rois: Tensor, *args) -> Tensor:
    """torchvision on the exact values given, in our working precision: the reference to compare with."""
    dtype = _working_dtype(x.dtype)
    return torchvision.ops.roi_align(x.to(dtype).contiguous(), rois.to(dtype), *args).double()


def _truth(x: Tensor, rois: Tensor, *args) -> Tensor:
    """torchvision in float64 on the CPU, on the exact values we were given."""
    return torchvision.ops.roi_align(x.double().cpu().contiguous(), rois.double().cpu(), *args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio", [-1, 2])
def test_roi_align_forward_matches_torchvision(device, dtype, layout, aligned, sampling_ratio):
    # a real box-head size: 2 images of 800 x 1216 at stride 8, 256 channels, 300 RoIs
    x = _features((2, 256, 100, 152), dtype, layout, device)
    rois = random_rois(300, 2, (800, 1216)).to(device)
    args = ((7, 7), 0.125, sampling_ratio, aligned)
    got = ops.roi_align(x, rois, *args)
    assert got.dtype == dtype and got.shape == (300, 256, 7, 7)
    assert got.is_contiguous(memory_format=layout)
    assert_as_close_as_theirs(
        got, _torchvision(x, rois, *args), _truth(x, rois, *args), atol=TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_torchvision(dtype):
    x = _features((2, 16, 40, 60), dtype, torch.contiguous_format)
    rois = random_rois(50, 2, (320, 480))
    for aligned in (False, True):
        args = ((5, 4), 0.125, -1, aligned)
        torch.testing.assert_close(
            reference.roi_align(x, rois, *args).double(),
            _torchvision(x, rois, *args),
            rtol=0,
            atol=TOLERANCE[dtype],
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rois_dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_rois_of_any_float_dtype(device, rois_dtype):
    x = _features((1, 8, 32, 32), torch.bfloat16, torch.contiguous_format, device)
    rois = torch.tensor([[0, 2.0, 3.0, 20.0, 30.0], [0, 0.5, 0.5, 8.0, 4.0]], device=device)
    got = ops.roi_align(x, rois.to(rois_dtype), 7, 0.5, 2)
    torch.testing.assert_close(
        got.double(), _torchvision(x, rois.to(rois_dtype), 7, 0.5, 2), rtol=0, atol=TOLERANCE[torch.bfloat16]
    )


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_half_features_with_fp32_rois(device):
    """The case that broke AMP for torchvision's R-CNN: fp32 RoIs meet half features under autocast."""
    half = torch.float16 if device == "cuda" else torch.bfloat16
    x = _features((2, 8, 32, 32), torch.float32, torch.contiguous_format, device)
    rois = random_rois(20, 2, (128, 128)).to(device)
    with torch.autocast(device, dtype=half):
        features = torch.nn.functional.conv2d(
            x, torch.eye(8, device=device)[:, :, None, None]
        )  # autocast -> half
        got = ops.roi_align(features, rois, 7, 0.25, 2)
    assert features.dtype == half and got.dtype == half
    torch.testing.assert_close(
        got.double(), _torchvision(features, rois, 7, 0.25, 2), rtol=0, atol=TOLERANCE[half]
    )


@pytest.mark.parametrize("device", DEVICES)
def test_boxes_as_a_list_per_image(device):
    x = _features((2, 4, 20, 20), torch.float32, torch.contiguous_format, device)
    boxes = [random_boxes(5, image=(80, 80)).to(device), random_boxes(3, image=(80, 80)).to(device)]
    got = ops.roi_align(x, boxes, 3, 0.25)
    torch.testing.assert_close(got, torchvision.ops.roi_align(x, boxes, 3, 0.25))


@pytest.mark.parametrize("device", DEVICES)
def test_degenerate_and_empty_rois(device):
    x = _features((1, 3, 16, 16), torch.float32, torch.contiguous_format, device)
    rois = torch.tensor(
        [
            [0, 5, 5, 5, 5],
            [0, -40, -40, -20, -20],
            [0, 30, 30, 60, 60],
            [0, 10, 10, 2, 2],
            [0, -3, -3, 40, 40],
        ],
        dtype=torch.float32,
        device=device,
    )
    for aligned in (False, True):
        torch.testing.assert_close(
            ops.roi_align(x, rois, 4, 1.0, -1, aligned),
            torchvision.ops.roi_align(x, rois, 4, 1.0, -1, aligned),
        )
    empty = ops.roi_align(x.requires_grad_(), rois[:0], (2, 3))
    assert empty.shape == (0, 3, 2, 3)
    empty.sum().backward()
    assert torch.count_nonzero(x.grad) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_roi_align_backward_matches_torchvision(device, dtype, layout):
    x = _features((2, 32, 50, 76), dtype, layout, device).requires_grad_()
    rois = random_rois(128, 2, (800, 1216)).to(device)
    # both implementations get the same rounded grad_out; torchvision works in fp32 on it
    grad_out = torch.randn(128, 32, 14, 14, generator=torch.Generator().manual_seed(9)).to(device, dtype)
    ops.roi_align(x, rois, 14, 1 / 16, 2).backward(grad_out)
    assert x.grad.dtype == dtype and x.grad.is_contiguous(memory_format=layout)
    x32 = x.detach().float().requires_grad_()
    torchvision.ops.roi_align(x32, rois, 14, 1 / 16, 2).backward(grad_out.float())
    # ours accumulates in fp32 and rounds once: within one output ulp of torchvision's fp32 gradient (plus
    # what a different fp32 summation order may move, far below a half-precision ulp)
    x64 = x.detach().double().cpu().requires_grad_()
    torchvision.ops.roi_align(x64, rois.double().cpu(), 14, 1 / 16, 2).backward(grad_out.double().cpu())
    assert_as_close_as_theirs(x.grad, x32.grad, x64.grad, atol=1e-5, relative=torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("channels", [1, 17, 67])
def test_half_channels_last_at_odd_channel_counts(dtype, channels):
    """The wide (AVX-512 / AVX2) channel loops of half channels_last features, remainders included."""
    x = _features((2, channels, 40, 60), dtype, torch.channels_last).requires_grad_()
    rois = random_rois(50, 2, (320, 480))
    grad_out = torch.randn(50, channels, 7, 7, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = ops.roi_align(x, rois, 7, 0.125, 2)
    torch.testing.assert_close(
        got.double(), _torchvision(x, rois, (7, 7), 0.125, 2), rtol=0, atol=TOLERANCE[dtype]
    )
    got.backward(grad_out)
    x32 = x.detach().float().requires_grad_()
    torchvision.ops.roi_align(x32, rois, 7, 0.125, 2).backward(grad_out.float())
    assert ((x.grad.float() - x32.grad).abs() <= torch.finfo(dtype).eps * x32.grad.abs() + 1e-5).all()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio", [-1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_roi_align_gradcheck(layout, aligned, sampling_ratio, seed):
    x = _features((2, 3, 10, 12), torch.float64, layout, seed=seed).requires_grad_()
    rois = random_rois(6, 2, (40, 48), generator=torch.Generator().manual_seed(seed)).double()
    assert torch.autograd.gradcheck(
        lambda t: ops.roi_align(t, rois, (3, 2), 0.25, sampling_ratio, aligned), (x,)
    )


def _levels_input(dtype, layout, device="cpu", channels=256):
    """Four FPN levels of a 2-image 800 x 1216 batch (strides 4..32) and 512 RoIs spread over them."""
    sizes = [(200, 304), (100, 152), (50, 76), (25, 38)]
    features = [
        _features((2, channels, h, w), dtype, layout, device, seed=i) for i, (h, w) in enumerate(sizes)
    ]
    rois = random_rois(512, 2, (800, 1216)).to(device)
    levels = torch.randint(4, (512,), generator=torch.Generator().manual_seed(4)).to(device)
    return features, rois, levels, [0.25, 0.125, 0.0625, 0.03125]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_multi_level_matches_a_per_level_loop(device, dtype, layout):
    features, rois, levels, scales = _levels_input(dtype, layout, device)
    got = ops.multi_level_roi_align(features, rois, levels, scales, 7, 2)
    assert got.dtype == dtype and got.is_contiguous(memory_format=layout)
    expected = reference.multi_level_roi_align([f.float() for f in features], rois, levels, scales, 7, 2)
    truth = reference.multi_level_roi_align(
        [f.double().cpu() for f in features], rois.double().cpu(), levels.cpu(), scales, 7, 2
    )
    assert_as_close_as_theirs(got, expected, truth, atol=TOLERANCE[dtype])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_multi_level_gradcheck(layout):
    features = [_features((2, 3, s, s), torch.float64, layout, seed=s).requires_grad_() for s in (16, 8, 4)]
    rois = random_rois(9, 2, (64, 64)).double()
    levels = torch.tensor([0, 1, 2, 2, 1, 0, 0, 2, 1])
    assert torch.autograd.gradcheck(
        lambda *f: ops.multi_level_roi_align(list(f), rois, levels, [0.25, 0.125, 0.0625], 3, -1), features
    )


def _fpn_input(device, dtype=torch.float32, layout=torch.contiguous_format):
    features, _, _, _ = _levels_input(dtype, layout, device, channels=64)
    x = {str(i): f.requires_grad_() for i, f in enumerate(features)}
    x["pool"] = torch.randn(2, 64, 13, 19, device=device, dtype=dtype)  # not pooled: not in featmap_names
    boxes = [
        random_boxes(300, image=(800, 1216), max_size=700, generator=torch.Generator().manual_seed(i)).to(
            device
        )
        for i in range(2)
    ]
    return x, boxes, [(800, 1216), (760, 1100)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("names", [["0", "1", "2", "3"], ["1"]])
def test_multi_scale_roi_align_is_a_drop_in_for_torchvision(device, names):
    x, boxes, shapes = _fpn_input(device)
    ours = ops.MultiScaleRoIAlign(names, 7, 2)
    theirs = torchvision.ops.MultiScaleRoIAlign(names, 7, 2)
    got, expected = ours(x, boxes, shapes), theirs(x, boxes, shapes)
    x64 = {name: value.detach().double().cpu().requires_grad_() for name, value in x.items()}
    truth = theirs(x64, [b.double().cpu() for b in boxes], shapes)
    assert_as_close_as_theirs(got, expected, truth, atol=1e-5, relative=1e-5)
    grad = torch.randn_like(got)
    ours_grads = torch.autograd.grad(got, [x[n] for n in names], grad)
    theirs_grads = torch.autograd.grad(expected, [x[n] for n in names], grad)
    true_grads = torch.autograd.grad(truth, [x64[n] for n in names], grad.double().cpu())
    for a, b, t in zip(ours_grads, theirs_grads, true_grads):
        assert_as_close_as_theirs(a, b, t, atol=1e-5, relative=1e-5)
    assert repr(ours).startswith("MultiScaleRoIAlign(featmap_names=")


def test_level_assignment_matches_torchvision():
    x, boxes, shapes = _fpn_input("cpu")
    theirs = torchvision.ops.MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)
    theirs(x, boxes, shapes)  # sets up its level mapper
    assert torch.equal(ops.assign_fpn_levels(boxes, 2, 5), theirs.map_levels(boxes))


def test_errors_name_the_problem():
    x = torch.randn(1, 2, 8, 8)
    with pytest.raises(ValueError, match=r"\[K, 5\]"):
        ops.roi_align(x, torch.zeros(3, 4), 2)
    with pytest.raises(ValueError, match=r"boxes\[1\]"):
        ops.roi_align(x, [torch.zeros(1, 4), torch.zeros(1, 5)], 2)
    with pytest.raises(ValueError, match="output_size"):
        ops.roi_align(x, torch.zeros(1, 5), (0, 2))
    with pytest.raises(RuntimeError, match="levels"):
        ops.multi_level_roi_align([x, x], torch.zeros(2, 5), torch.tensor([0]), [1.0, 0.5], 2)
    with pytest.raises(KeyError, match="featmap_names"):
        ops.MultiScaleRoIAlign(["p2"], 7, 2)({"0": x}, [torch.zeros(1, 4)], [(8, 8)])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opcheck(layout):
    x = _features((2, 4, 12, 12), torch.float32, layout).requires_grad_()
    rois = random_rois(5, 2, (48, 48))
    torch.library.opcheck(torch.ops.lit_amp_det.roi_align.default, (x, rois, 0.25, 3, 3, 2, False))
    features = [x, _features((2, 4, 6, 6), torch.float32, layout).requires_grad_()]
    levels = torch.tensor([0, 1, 1, 0, 1])
    torch.library.opcheck(
        torch.ops.lit_amp_det.multi_level_roi_align.default,
        (features, rois, levels, [0.25, 0.125], 3, 3, 2, True),
    )


def test_compile_fullgraph():
    x, boxes, shapes = _fpn_input("cpu")
    pooler = ops.MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)

    def pool(x, boxes):
        return pooler(x, boxes, shapes).sum() + ops.roi_align(x["0"], boxes, 5, 0.25).sum()

    compiled = torch.compile(pool, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, boxes), pool(x, boxes))

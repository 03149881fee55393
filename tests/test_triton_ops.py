"""The Triton kernels (the CUDA kernels of every op) executed by Triton's interpreter on CPU tensors.

Each launcher of :mod:`lit_amp_det.ops.triton._launch` (what the ops run on CUDA tensors) is compared with the
C++ CPU kernel (``torch.ops.lit_amp_det``) and with :mod:`lit_amp_det.ops.reference` on every dtype and
layout, at sizes small enough for the interpreter but large enough to span several tiles. Interpreter facts
these tests rely on: the kernels upcast right after every load (bf16 arithmetic inside an interpreted kernel
is wrong), and interpreted bf16 stores truncate instead of rounding, so bf16 outputs are compared to within 1
ulp; fp16 stores round, so they are compared exactly.
"""

from __future__ import annotations

import math

import pytest
import torch
import torchvision
import triton
import triton.language as tl

import lit_amp_det.ops as ops
from lit_amp_det.ops import reference
from lit_amp_det.ops.triton import _launch, _register
from ops_inputs import distinct_scores, needs_extension, random_boxes, random_rois

pytestmark = needs_extension

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
LAYOUTS = [torch.contiguous_format, torch.channels_last]
cpu_kernels = torch.ops.lit_amp_det


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    """CPU tensors reach the kernels only through Triton's interpreter, which TRITON_INTERPRET=1 turns on."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, atol: float = 0.0) -> None:
    """got (in ``dtype``) against expected (accumulation precision): exact rounding for fp16/fp32/fp64 up to
    ``atol``, within 1 ulp for bf16 (the interpreter truncates bf16 stores).
    """
    assert got.dtype == dtype
    got, expected = got.double(), expected.double()
    if dtype == torch.bfloat16:
        magnitude = expected.abs().clamp(min=2.0**-126)
        ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - 7)
        excess = (got - expected).abs() - ulp - atol
        assert excess.max().item() <= 0, f"bf16 off by more than 1 ulp: {excess.max().item()}"
    elif dtype == torch.float16:
        torch.testing.assert_close(got, expected.half().double(), rtol=0, atol=atol)
    else:
        torch.testing.assert_close(got, expected, rtol=0, atol=atol)


# --------------------------------------------------------------------------------------------------------
# box_iou


@pytest.mark.parametrize("dtype", FLOATS + [torch.int64, torch.int32])
def test_box_iou_matches_the_cpu_kernel_across_tiles(dtype):
    # 70 x 150 outputs: two row tiles and two column tiles of the interpreter's 64 x 128 blocks
    a = random_boxes(70, image=(200, 300), max_size=80)
    b = random_boxes(150, image=(200, 300), max_size=80, generator=torch.Generator().manual_seed(5))
    a[:3] = torch.tensor([[5.0, 5, 5, 9], [0, 0, 0, 0], [300, 10, 400, 20]])  # zero-area, empty, out of image
    b[:2] = torch.tensor([[0.0, 0, 0, 0], [5, 5, 5, 9]])
    if dtype.is_floating_point:
        a, b = a.to(dtype), b.to(dtype)
    else:
        a, b = a.round().to(dtype), b.round().to(dtype)
    got = _launch.box_iou(a, b)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    if dtype.is_floating_point:
        assert torch.equal(got, cpu_kernels.box_iou(a, b))
        torch.testing.assert_close(got, reference.box_iou(a, b), rtol=0, atol=0)
    else:  # torchvision's integer semantics: exact integer areas, one float32 division
        expected = torchvision.ops.box_iou(a, b).nan_to_num(0.0)
        assert torch.equal(got, expected)
    assert got[1, 0] == 0 and got[0, 1] == 0  # zero-area pairs: 0, never NaN


@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")  # numpy: inf - inf
def test_box_iou_is_never_nan():
    inf, nan = math.inf, math.nan
    a = torch.tensor([[0.0, 0, 1, 1], [0, 0, inf, 1], [-inf, 0, inf, 1], [nan, 0, 1, 1], [0, 0, 0, 0]])
    got = _launch.box_iou(a, a)
    assert not got.isnan().any()
    assert got[0, 0] == 1 and got[0, 1] == 0 and got[2, 2] == 0 and got[3, 3] == 0 and got[4, 4] == 0


def test_box_iou_empty_and_fp64_mixed():
    assert _launch.box_iou(torch.zeros(0, 4), torch.rand(3, 4)).shape == (0, 3)
    a, b = random_boxes(5).double(), random_boxes(4)
    got = _launch.box_iou(a, b)
    assert got.dtype == torch.float64
    assert torch.equal(got, reference.box_iou(a, b))


# --------------------------------------------------------------------------------------------------------
# NMS


def _nms_inputs(n: int, dtype: torch.dtype, clusters: int = 0):
    boxes = random_boxes(n, image=(300, 400), max_size=120, clusters=clusters).to(dtype)
    return boxes, distinct_scores(n)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("clusters", [0, 6])
def test_nms_matches_the_cpu_kernel_and_torchvision(dtype, clusters):
    boxes, scores = _nms_inputs(200, dtype, clusters)  # 4 mask words: tiles off the diagonal too
    got = _launch.nms(boxes, scores, 0.5)
    assert got.dtype == torch.int64
    assert torch.equal(got, cpu_kernels.nms(boxes, scores, 0.5))
    expected = torchvision.ops.nms(boxes.to(_acc(dtype)), scores.to(_acc(dtype)), 0.5)
    assert torch.equal(got, expected)
    assert torch.equal(reference.nms(boxes, scores, 0.5), expected)


@pytest.mark.parametrize("max_output", [0, 1, 7, 10_000])
def test_nms_max_output_is_a_prefix_and_padded_agrees(max_output):
    boxes, scores = _nms_inputs(200, torch.float32, clusters=10)
    full = cpu_kernels.nms(boxes, scores, 0.6)
    assert full.numel() > 7
    got = _launch.nms(boxes, scores, 0.6, max_output)
    assert torch.equal(got, full[:max_output])
    keep, count = _launch.nms_padded(boxes, scores, 0.6, max_output)
    assert keep.shape == (min(200, max_output),) and count.dim() == 0 and count.dtype == torch.int64
    assert torch.equal(keep[: int(count)], got)
    assert (keep[int(count) :] == -1).all()


def test_nms_ties_nan_scores_and_threshold_rounding():
    boxes = random_boxes(150, image=(100, 100), max_size=60)
    tied = torch.randint(0, 4, (150,), generator=torch.Generator().manual_seed(3)).float()
    assert torch.equal(_launch.nms(boxes, tied, 0.3), torchvision.ops.nms(boxes, tied, 0.3))
    tied[::7] = math.nan
    assert torch.equal(_launch.nms(boxes, tied, 0.3), cpu_kernels.nms(boxes, tied, 0.3))
    # IoU 1/10 in fp32 is above the double 0.1: torchvision suppresses, so must we
    pair = torch.tensor([[0.0, 0, 10, 1], [0, 0, 1, 1]])
    two = torch.tensor([0.9, 0.8])
    assert _launch.nms(pair, two, 0.1).tolist() == torchvision.ops.nms(pair, two, 0.1).tolist() == [0]
    # IoU exactly at the threshold does not suppress (fp64 keeps the double threshold)
    exact = torch.tensor([[0.0, 0, 2, 1], [0, 0, 1, 1]])
    for dtype in (torch.float32, torch.float64, torch.float16):
        assert _launch.nms(exact.to(dtype), two, 0.5).tolist() == [0, 1]
        assert _launch.nms(exact.to(dtype), two, 0.4999).tolist() == [0]


def test_nms_empty_zero_area_and_out_of_image():
    empty = _launch.nms(torch.zeros(0, 4), torch.zeros(0), 0.5)
    assert empty.dtype == torch.int64 and empty.numel() == 0
    keep, count = _launch.nms_padded(torch.zeros(0, 4), torch.zeros(0), 0.5)
    assert keep.numel() == 0 and int(count) == 0
    boxes = torch.tensor(
        [[3.0, 3, 3, 3], [3, 3, 3, 3], [-50, -50, -10, -10], [-49, -50, -10, -10], [0, 0, 5, 5]]
    )
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5])
    assert (
        _launch.nms(boxes, scores, 0.5).tolist()
        == cpu_kernels.nms(boxes, scores, 0.5).tolist()
        == [0, 1, 2, 4]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("max_output", [-1, 1, 9])
def test_batched_nms_keeps_classes_apart(dtype, max_output):
    boxes, scores = _nms_inputs(180, dtype, clusters=5)
    g = torch.Generator().manual_seed(4)
    # a few large and negative class ids, unevenly sized classes
    classes = torch.tensor([-7, 0, 3, 10**12])[torch.randint(4, (180,), generator=g)]
    got = _launch.batched_nms(boxes, scores, classes, 0.4, max_output)
    assert torch.equal(got, cpu_kernels.batched_nms(boxes, scores, classes, 0.4, max_output))
    # torchvision's coordinate-offset trick loses precision with ids like 1e12: the per-class reference is the
    # oracle
    assert torch.equal(got, reference.batched_nms(boxes, scores, classes, 0.4, max_output))
    keep, count = _launch.batched_nms_padded(boxes, scores, classes, 0.4, max_output)
    assert torch.equal(keep[: int(count)], got)


def test_nms_inputs_are_checked():
    with pytest.raises(ValueError, match=r"boxes.*\[N, 4\].*\[3, 5\]"):
        _launch.nms(torch.zeros(3, 5), torch.zeros(3), 0.5)
    with pytest.raises(ValueError, match=r"\bscores\b.*\[2\]"):
        _launch.nms(torch.zeros(3, 4), torch.zeros(2), 0.5)
    with pytest.raises(TypeError, match=r"\bidxs\b"):
        _launch.batched_nms(torch.zeros(3, 4), torch.zeros(3), torch.zeros(3), 0.5)


def test_cpu_tensors_without_the_interpreter_say_what_to_do(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _launch.box_iou(torch.zeros(1, 4), torch.zeros(1, 4))


# --------------------------------------------------------------------------------------------------------
# RoIAlign


def _features(shape, dtype, layout, seed=0):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x.to(dtype).contiguous(memory_format=layout)


def _rois(k=12, batch=2, image=(64, 80)):
    rois = random_rois(k, batch, image)
    rois[0, 1:] = torch.tensor([10.0, 10, 10, 10])  # zero area
    rois[1, 1:] = torch.tensor([70.0, 60, 120, 90])  # mostly outside the image
    rois[2, 1:] = torch.tensor([-30.0, -20, 5, 4])  # starts outside
    return rois


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio", [-1, 2])
def test_roi_align_forward_matches_the_cpu_kernel(dtype, layout, aligned, sampling_ratio):
    x = _features((2, 6, 16, 20), dtype, layout)
    rois = _rois()
    args = (0.25, 3, 2, sampling_ratio, aligned)
    got = _launch.roi_align(x, rois, *args)
    assert got.shape == (12, 6, 3, 2) and got.is_contiguous(memory_format=layout)
    # the same values in the accumulation precision: the sums are the CPU kernel's, bit for bit
    expected = cpu_kernels.roi_align(x.to(_acc(dtype)), rois.to(_acc(dtype)), *args)
    assert_matches(got, expected, dtype)
    reference_out = reference.roi_align(x, rois, (3, 2), 0.25, sampling_ratio, aligned).double()
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.double(), reference_out, rtol=0, atol=tolerance)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_roi_align_backward_matches_the_cpu_kernel_and_keeps_the_layout(dtype, layout):
    x = _features((2, 5, 12, 14), dtype, layout, seed=1)
    rois = _rois(10, 2, (48, 56))
    grad = _features((10, 5, 2, 3), dtype, layout, seed=2)
    args = (0.25, 2, 3, 2, 5, 12, 14, -1, True)
    got = _launch.roi_align_backward(grad, rois, *args)
    assert got.dtype == dtype and got.shape == x.shape
    assert got.is_contiguous(memory_format=layout), (
        "the gradient must follow the layout of grad (and the input)"
    )
    expected = cpu_kernels._roi_align_backward(grad.to(_acc(dtype)), rois, *args)
    assert_matches(got, expected, dtype, atol=1e-5 if dtype != torch.float64 else 1e-12)


def _gpu_config(kernel: str, meta: dict) -> tuple:
    """What distinguishes one CUDA launch configuration from another: kernel, warps, tile (elements per
    program).
    """
    tile = meta.get("BLOCK_P", 1) * meta["BLOCK_C"] if "BLOCK_C" in meta else None
    return kernel, meta.get("num_warps", 4), tile, meta.get("BLOCK_N"), meta.get("BLOCK_M")


@pytest.mark.slow
def test_every_gpu_launch_configuration_runs_in_the_interpreter_and_agrees(monkeypatch):
    """Under ``gpu_launch_configs()`` the interpreter runs the blocks a CUDA device gets: box IoU, NMS past 16
    mask words (1,100 boxes), RoIAlign at the box head's, mask head's and mask targets' pools (9 channels:
    several channel blocks, a partial last one) forward, atomic backward and owned backward, each against the
    CPU kernels. Every configuration the model's launches take on a GPU (``make gpu-compile``'s, recorded on
    fake CUDA tensors) must be among those run here: a launcher that gains one fails this test until it is
    run.
    """
    from triton_compile import model_launches

    ran = set()
    run = _launch._launch

    def record(kernel, grid, *args, **meta):
        ran.add(_gpu_config(kernel.fn.__name__, meta))
        return run(kernel, grid, *args, **meta)

    with _launch.gpu_launch_configs():
        monkeypatch.setattr(_launch, "_launch", record)
        boxes, scores = _nms_inputs(1100, torch.float32, clusters=40)
        iou = _launch.box_iou(boxes[:70].half(), boxes[:5].half())
        torch.testing.assert_close(
            iou, cpu_kernels.box_iou(boxes[:70].half(), boxes[:5].half()), rtol=0, atol=0
        )
        assert torch.equal(_launch.nms(boxes, scores, 0.5), cpu_kernels.nms(boxes, scores, 0.5))
        classes = torch.randint(3, (1100,), generator=torch.Generator().manual_seed(2))
        assert torch.equal(
            _launch.batched_nms(boxes, scores, classes, 0.5, 300),
            cpu_kernels.batched_nms(boxes, scores, classes, 0.5, 300),
        )
        rois = _rois(5, 2, (48, 56))
        for pool, dtype, layout in (
            (7, torch.float16, torch.channels_last),
            (14, torch.float32, torch.contiguous_format),
            (28, torch.bfloat16, torch.channels_last),
        ):
            x = _features((2, 9, 12, 14), dtype, layout, seed=3)
            block_p, block_c, _ = _launch._blocks(9, pool * pool, x.device)
            assert block_p * block_c >= _launch.GPU_TILE and 9 % block_c in (1, 0 if block_c == 1 else 1)
            got = _launch.roi_align(x, rois, 0.25, pool, pool, 2, True)
            assert_matches(
                got, cpu_kernels.roi_align(x.to(_acc(dtype)), rois, 0.25, pool, pool, 2, True), dtype
            )
            grad = _features((5, 9, pool, pool), dtype, layout, seed=4)
            args = (0.25, pool, pool, 2, 9, 12, 14, 2, True)
            expected = cpu_kernels._roi_align_backward(grad.to(_acc(dtype)), rois, *args)
            # the atomics add in another order than the CPU kernel: fp32 sums differ in their last bits, a
            # half result may round one ulp apart
            atol = expected.abs().max().item() * (2.0**-16 if dtype == torch.float32 else 2.0**-7)
            assert_matches(_launch.roi_align_backward(grad, rois, *args), expected, dtype, atol=atol)
        # the owned backward's GPU block (up to 32 channels, whatever the pool, so a 2 x 2 pool: interpreted,
        # it costs its bins) on 33 channels (a partial second block) and on one (mask targets), two RoIs; its
        # tiles: test_the_tiled_deterministic_backward_adds_in_the_serial_order
        for channels in (33, 1):
            grad = _features((2, channels, 2, 2), torch.float32, torch.channels_last, seed=6)
            args = (0.25, 2, 2, 2, channels, 12, 14, 2, True)
            with _deterministic():
                owned = _launch.roi_align_backward(grad, rois[3:5], *args)
            expected = cpu_kernels._roi_align_backward(grad, rois[3:5], *args)
            torch.testing.assert_close(owned, expected, rtol=0, atol=1e-6)
    model = {
        _gpu_config(launch.kernel, launch.meta)
        for launch in model_launches(
            dtypes=(torch.float16,), pools=(7, 14, 28), channels=(256,), layouts=(torch.channels_last,)
        )
    }
    assert model <= ran, (
        f"CUDA launch configurations no interpreter test runs: {sorted(model - ran, key=str)}"
    )


def test_roi_align_deterministic_backward_is_the_same(monkeypatch):
    rois = _rois(6, 2, (40, 48))
    grad = _features((6, 4, 2, 2), torch.float64, torch.channels_last, seed=4)
    args = (0.25, 2, 2, 2, 4, 10, 12, 2, False)
    atomic = _launch.roi_align_backward(grad, rois, *args)
    with _deterministic():
        owned = _launch.roi_align_backward(grad, rois, *args)
    assert owned.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(owned, atomic, rtol=0, atol=1e-13)
    torch.testing.assert_close(owned, cpu_kernels._roi_align_backward(grad, rois, *args), rtol=0, atol=1e-13)


@pytest.mark.parametrize(
    ("dtype", "layout", "aligned", "sampling_ratio"),
    [
        (torch.float32, torch.channels_last, True, 2),
        (torch.float16, torch.contiguous_format, False, 2),
        (torch.float64, torch.channels_last, False, -1),
        (torch.bfloat16, torch.contiguous_format, True, 1),
    ],
)
def test_the_tiled_deterministic_backward_adds_in_the_serial_order(dtype, layout, aligned, sampling_ratio):
    """The GPU's owned backward (``OWNED_TILE``-pixel tiles: here a 70 x 36 level and a 20 x 18 one, RoIs
    crossing tile edges, leaving the map, of zero and negative size, NaN and of an image outside the batch)
    gives bit for bit the sums of one tile a map (the serial walk), because every element still adds in (roi,
    bin, sample, corner) order; and agrees with the CPU kernel. Levels, aligned and adaptive sampling, every
    float dtype.
    """
    features = [_features((2, 3, 70, 36), dtype, layout, 0), _features((2, 3, 20, 18), dtype, layout, 1)]
    g = torch.Generator().manual_seed(
        8
    )  # RoIs of up to 10 level-0 pixels (adaptive sampling costs their area)
    rois = torch.cat(
        [
            torch.randint(2, (9, 1), generator=g).float(),
            random_boxes(9, image=(280, 144), min_size=1.0, max_size=40.0, generator=g),
        ],
        dim=1,
    )
    rois[2, 1:] = torch.tensor([-30.0, 100, 20, 150])  # leaves the map, crosses the tile edge at row 32
    rois[3, 1:] = torch.tensor(
        [40.0, 120, 30, 100]
    )  # negative size: aligned pools it, unaligned forces 1 x 1
    rois[4, 0] = 5.0  # an image outside the batch
    rois[5, 1:] = torch.tensor([float("nan"), 10, 60, 50])
    levels = torch.tensor([0, 1, 0, 1, 0, 0, 0, 1, 0])
    scales, args = [0.25, 0.125], (2, 2, sampling_ratio, aligned)
    grad = _features((9, 3, 2, 2), dtype, layout, 5)
    with _deterministic():
        with _launch.gpu_launch_configs():
            tiled = _launch.multi_level_roi_align_backward(grad, features, rois, levels, scales, *args)
        serial = _launch.multi_level_roi_align_backward(grad, features, rois, levels, scales, *args)
    assert _launch.OWNED_TILE < 70 and features[0].shape[2] // _launch.OWNED_TILE >= 2
    acc = [f.to(_acc(dtype)) for f in features]
    expected = cpu_kernels._multi_level_roi_align_backward(
        grad.to(_acc(dtype)), acc, rois, levels, scales, *args
    )
    for t, s, e in zip(tiled, serial, expected):
        assert torch.equal(t, s) and t.is_contiguous(memory_format=layout)
        assert_matches(t, e, dtype, atol=1e-6 * e.abs().max().item())


class _deterministic:
    def __enter__(self):
        self.previous = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.previous)


def test_rois_of_other_images_and_bad_batch_indices():
    x = _features((3, 4, 12, 12), torch.float32, torch.contiguous_format).requires_grad_()  # for torchvision
    rois = torch.tensor(
        [
            [0, 1.0, 1, 20, 20],
            [2, 4, 4, 30, 40],
            [3, 1, 1, 9, 9],
            [-1, 1, 1, 9, 9],
            [1, 0, 0, 40, 40],
            [2.9, 2, 2, 12, 12],
        ]
    )
    got = _launch.roi_align(x, rois, 0.25, 2, 2, 2, False)
    assert torch.equal(got[2:4], torch.zeros_like(got[2:4]))  # index 3 and -1 are outside [0, 3)
    good = torch.tensor([0, 1, 4, 5])
    torch.testing.assert_close(
        got[good], torchvision.ops.roi_align(x, rois[good], 2, 0.25, 2), rtol=0, atol=1e-6
    )
    grad = _launch.roi_align_backward(torch.ones_like(got), rois, 0.25, 2, 2, *x.shape, 2, False)
    expected = torch.autograd.grad(torchvision.ops.roi_align(x, rois[good], 2, 0.25, 2).sum(), x)[0]
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-6)


def test_roi_align_empty_inputs():
    x = _features((1, 3, 8, 8), torch.float16, torch.channels_last)
    out = _launch.roi_align(x, torch.zeros(0, 5), 1.0, 7, 7, -1, False)
    assert out.shape == (0, 3, 7, 7) and out.dtype == torch.float16
    grad = _launch.roi_align_backward(out, torch.zeros(0, 5), 1.0, 7, 7, *x.shape, -1, False)
    assert grad.dtype == torch.float16 and torch.equal(grad, torch.zeros_like(x))


class _LaunchedRoIAlign(torch.autograd.Function):
    """The forward and backward launchers paired as ``lit_amp_det.ops.roi_align``'s autograd formula pairs the
    two ops whose CUDA kernels they are (``roi_align`` and ``_roi_align_backward``).
    """

    @staticmethod
    def forward(ctx, input: torch.Tensor, rois: torch.Tensor, *args) -> torch.Tensor:
        ctx.save_for_backward(rois)
        ctx.shape, ctx.args = tuple(input.shape), args
        return _launch.roi_align(input, rois, *args)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rois,) = ctx.saved_tensors
        scale, pooled_height, pooled_width, sampling_ratio, aligned = ctx.args
        args = (scale, pooled_height, pooled_width, *ctx.shape, sampling_ratio, aligned)
        return _launch.roi_align_backward(grad, rois, *args), None, *(None for _ in ctx.args)


@pytest.mark.slow
def test_roi_align_gradcheck_fp64():
    x = _features((1, 2, 4, 5), torch.float64, torch.contiguous_format, seed=7).requires_grad_()
    rois = torch.tensor([[0, 0.3, 0.6, 4.1, 3.7], [0, 1.2, -0.5, 6.5, 4.2]], dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda t: _LaunchedRoIAlign.apply(t, rois, 1.0, 2, 2, 2, True), (x,), eps=1e-6, atol=1e-8
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_multi_level_matches_the_cpu_kernel(dtype, layout):
    features = [
        _features((2, 4, 16, 20), dtype, layout, 0),
        _features((2, 4, 8, 10), dtype, layout, 1),
        _features((2, 4, 4, 5), dtype, layout, 2),
    ]
    rois = _rois(14, 2, (64, 80))
    levels = torch.randint(3, (14,), generator=torch.Generator().manual_seed(9))
    scales, args = [0.25, 0.125, 0.0625], (3, 3, -1, False)
    got = _launch.multi_level_roi_align(features, rois, levels, scales, *args)
    assert got.is_contiguous(memory_format=layout)
    acc = [f.float() for f in features]
    assert_matches(got, cpu_kernels.multi_level_roi_align(acc, rois, levels, scales, *args), dtype)
    grad = _features(tuple(got.shape), dtype, layout, 5)
    grads = _launch.multi_level_roi_align_backward(grad, features, rois, levels, scales, *args)
    expected = cpu_kernels._multi_level_roi_align_backward(grad.float(), acc, rois, levels, scales, *args)
    for g, e, f in zip(grads, expected, features):
        assert g.shape == f.shape and g.is_contiguous(memory_format=layout)
        assert_matches(g, e, dtype, atol=1e-5)


# --------------------------------------------------------------------------------------------------------
# Registration as the CUDA kernels of torch.ops.lit_amp_det


def test_triton_launchers_are_the_cuda_kernels():
    assert _register.registered() and ops._extension.triton_cuda_kernels()
    for name in (
        "nms",
        "batched_nms",
        "batched_nms_padded",
        "box_iou",
        "roi_align",
        "_roi_align_backward",
        "multi_level_roi_align",
        "_multi_level_roi_align_backward",
    ):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"lit_amp_det::{name}", "CUDA"), name
    assert ops._extension.has_kernel("nms", torch.device("cuda"))
    assert _register.register_cuda_kernels()  # idempotent: no second registration


def test_registered_cuda_kernels_follow_the_schemas():
    """The functions registered for CUDA, called with the schema's arguments (interpreted on CPU tensors)."""
    kernels = _register._KERNELS
    boxes, scores = _nms_inputs(70, torch.float32, clusters=3)
    assert torch.equal(kernels["nms"](boxes, scores, 0.5, 5), cpu_kernels.nms(boxes, scores, 0.5, 5))
    classes, valid = torch.arange(70) % 3, scores > 0.3
    for got, expected in zip(
        kernels["batched_nms_padded"](boxes, scores, classes, valid, 0.5, 9, 30),
        cpu_kernels.batched_nms_padded(boxes, scores, classes, valid, 0.5, 9, 30),
    ):
        assert torch.equal(got, expected)
    x = _features((1, 3, 8, 8), torch.float32, torch.contiguous_format)
    rois = _rois(4, 1, (32, 32))
    out = kernels["roi_align"](x, rois, 0.25, 2, 2, 2, False)
    torch.testing.assert_close(out, cpu_kernels.roi_align(x, rois, 0.25, 2, 2, 2, False), rtol=0, atol=1e-6)
    grads = kernels["_multi_level_roi_align_backward"](
        torch.ones(4, 3, 2, 2),
        [x, x[:, :, ::2, ::2].contiguous()],
        rois,
        torch.tensor([0, 1, 1, 0]),
        [0.25, 0.125],
        2,
        2,
        2,
        False,
    )
    assert isinstance(grads, list) and [tuple(g.shape) for g in grads] == [(1, 3, 8, 8), (1, 3, 4, 4)]


# --------------------------------------------------------------------------------------------------------
# The interpreter facts the tolerances above rest on


def _store_source(src, dst):
    tl.store(dst, tl.load(src).to(dst.dtype.element_ty))


def test_interpreter_truncates_bf16_stores():
    """Interpreted bf16 stores truncate where a GPU rounds to nearest: the reason bf16 outputs are compared to
    1 ulp above. If a Triton upgrade makes them round, those comparisons can become exact.
    """
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        kernel = triton.jit(_store_source)
    value = torch.tensor([1 + 2**-8 + 2**-9])  # above the midpoint of the bf16 neighbours 1 and 1 + 2^-7
    out = torch.empty(1, dtype=torch.bfloat16)
    kernel[(1,)](value, out)
    assert value.bfloat16().item() == 1 + 2**-7  # round to nearest
    assert out.item() == 1.0, "the interpreter now rounds bf16 stores: compare bf16 outputs exactly"

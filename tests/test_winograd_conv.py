"""model.winograd_convs: 3x3 convolutions by Winograd F(2x2, 3x3) tiles equal torch's convolution.

The three tile-transform ops (C++ CPU kernels) are checked against their plain-PyTorch reference in every dtype, on
odd, one-pixel and empty maps, channel counts that are not a multiple of the kernels' chunk, and NCHW inputs. The
composed convolution is checked against ``F.conv2d``: to rounding in float64 and float32, within a measured bound in
bf16/fp16 (the transformed tiles are rounded to the half dtype), with gradients (float64 gradcheck, each input's
gradient alone), autocast, the R50-FPN mask head's real size; then the layer's dispatch rule, conv-BN folding through
it, and the model-level switch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_config, smooth_activations
from hydra.utils import instantiate
from torch import nn

from lit_amp_det import cpu_model
from lit_amp_det.models.conv_bn import enable_conv_bn_eval, find_conv_norm_pairs
from lit_amp_det.models.winograd_conv import (
    MIN_TILES,
    SPLIT_VECTOR_MIN_TILES,
    WinogradConv2d,
    half_min_tiles,
    is_winograd_shape,
    use_winograd_convs,
    winograd_conv3x3,
)
from lit_amp_det.ops import reference, winograd_gradient_tiles, winograd_input_tiles, winograd_output, winograd_output_
from lit_amp_det.ops._extension import extension_available
from lit_amp_det.ops.winograd import (
    tile_count,
    winograd_gradient_tiles_,
    winograd_input_tiles_,
    winograd_weight_gradient,
    winograd_weight_tiles,
)

needs_ext = pytest.mark.skipif(not extension_available(), reason="the compiled extension is not built")
NHWC = torch.channels_last
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
#: [N, C, H, W]: even and odd sizes, a single pixel, a channel count above and not a multiple of the 256-wide chunk
MAPS = [(2, 5, 14, 14), (1, 70, 7, 9), (3, 9, 1, 1), (2, 3, 2, 5), (1, 300, 3, 4)]


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _close_to_rounding(actual: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor) -> None:
    """Equal up to the rounding of the result's dtype plus the summation error of at most 16 terms in the kernel's
    accumulation type (fp32, fp64 for fp64): the kernel and the reference add in different orders."""
    acc = torch.float64 if actual.dtype == torch.float64 else torch.float32
    atol = 16 * torch.finfo(acc).eps * inputs.double().abs().max().item() + 1e-30
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=torch.finfo(actual.dtype).eps)


def _reference_tiles(name: str, x: torch.Tensor) -> torch.Tensor:
    """All tiles of ``x`` by the reference ``winograd_input_tiles_`` / ``winograd_gradient_tiles_``."""
    n, c, h, w = x.shape
    tiles = torch.empty(16, tile_count(n, h, w), c, dtype=x.dtype)
    getattr(reference, name)(tiles, x)
    return tiles


def _reference_output(products: torch.Tensor, n: int, h: int, w: int, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.zeros(n, products.shape[2], h, w, dtype=products.dtype).contiguous(memory_format=NHWC)
    reference.winograd_output_(out, products, bias)
    return out


def _use_kernels(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``lit_amp_det.ops.winograd``'s ops by their C++ kernels (skipped without the extension), or by their
    references."""
    if compiled and not extension_available():
        pytest.skip("the compiled extension is not built")
    if not compiled:
        monkeypatch.setattr("lit_amp_det.ops.winograd.extension_available", lambda: False)


# ------------------------------------------------------------------------------------------- the ops

@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", MAPS, ids=str)
def test_tile_ops_match_the_reference(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    x = _randn(*shape, dtype=dtype)
    for op, ref in ((winograd_input_tiles, "winograd_input_tiles_"),
                    (winograd_gradient_tiles, "winograd_gradient_tiles_")):
        for layout in (torch.contiguous_format, NHWC):
            out = op(x.contiguous(memory_format=layout))
            n, c, h, w = shape
            assert out.shape == (16, n * ((h + 1) // 2) * ((w + 1) // 2), c) and out.dtype == dtype
            _close_to_rounding(out, _reference_tiles(ref, x), x)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", MAPS, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_output_op_matches_the_reference(dtype: torch.dtype, shape: tuple[int, int, int, int], bias: bool) -> None:
    n, c, h, w = shape
    products = _randn(16, n * ((h + 1) // 2) * ((w + 1) // 2), c, dtype=dtype)
    b = _randn(c, dtype=dtype, seed=1) if bias else None
    out = winograd_output(products, n, h, w, b)
    assert out.shape == shape and out.dtype == dtype and out.is_contiguous(memory_format=NHWC)
    _close_to_rounding(out, _reference_output(products, n, h, w, b), products)


@needs_ext
@pytest.mark.parametrize("shape", [(0, 4, 6, 6), (2, 0, 6, 6), (2, 4, 0, 6)], ids=str)
def test_empty_maps(shape: tuple[int, int, int, int]) -> None:
    x = torch.zeros(shape, dtype=torch.bfloat16)
    n, c, h, w = shape
    tiles = winograd_input_tiles(x)
    assert tiles.shape == (16, n * ((h + 1) // 2) * ((w + 1) // 2), c)
    assert winograd_gradient_tiles(x).shape == tiles.shape
    assert winograd_output(tiles, n, h, w).shape == shape


@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "reference"])
def test_tile_ranges_are_slices_of_the_whole(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles [b, e) are columns b..e of all tiles, and writing the products chunk by chunk makes the whole map; a
    chunk leaves every other pixel as it was."""
    _use_kernels(compiled, monkeypatch)
    n, c, h, w = 2, 6, 5, 7
    x = _randn(n, c, h, w, dtype=torch.float64)
    tiles = tile_count(n, h, w)
    assert tiles == 2 * 3 * 4
    for op in (winograd_input_tiles, winograd_gradient_tiles):
        whole = op(x)
        for begin, end in ((0, 5), (5, 13), (13, tiles), (7, 7)):
            torch.testing.assert_close(op(x, begin, end), whole[:, begin:end], atol=0, rtol=0)
    products = _randn(16, tiles, c, dtype=torch.float64, seed=1)
    bias = _randn(c, dtype=torch.float64, seed=2)
    whole = winograd_output(products, n, h, w, bias)
    out = torch.full_like(whole, float("nan"))
    winograd_output_(out, products[:, 5:13], bias, 5)
    written = ~out.isnan()
    assert written.any() and not written.all()
    torch.testing.assert_close(out[written], whole[written], atol=0, rtol=0)
    for begin, end in ((0, 5), (13, tiles)):
        winograd_output_(out, products[:, begin:end], bias, begin)
    torch.testing.assert_close(out, whole, atol=0, rtol=0)


def test_bad_ranges_and_outputs_are_refused() -> None:
    x = torch.zeros(1, 2, 4, 4)  # 4 tiles
    with pytest.raises(ValueError, match=r"winograd_input_tiles: tiles \[3, 5\) are not a range of the map's 4 tiles"):
        winograd_input_tiles(x, 3, 5)
    with pytest.raises(ValueError, match=r"winograd_gradient_tiles: tiles \[3, 2\) are not a range"):
        winograd_gradient_tiles(x, 3, 2)
    out = torch.zeros(1, 2, 4, 4).contiguous(memory_format=NHWC)
    with pytest.raises(ValueError, match=r"winograd_output_: tiles \[2, 5\) are not a range"):
        winograd_output_(out, torch.zeros(16, 3, 2), None, 2)
    with pytest.raises(ValueError, match="winograd_output_: out must be channels_last"):
        winograd_output_(torch.zeros(1, 2, 4, 4), torch.zeros(16, 4, 2))
    with pytest.raises(ValueError, match="winograd_output_: products are torch.bfloat16 but out is torch.float32"):
        winograd_output_(out, torch.zeros(16, 4, 2, dtype=torch.bfloat16))
    with pytest.raises(ValueError,
                       match=r"winograd_input_tiles_: tiles must be a contiguous \[16 or 36, T, 2\] tensor"):
        winograd_input_tiles_(torch.zeros(16, 4, 3), x)
    with pytest.raises(ValueError, match="winograd_gradient_tiles_: tiles are torch.bfloat16 but grad_output is"):
        winograd_gradient_tiles_(torch.zeros(16, 4, 2, dtype=torch.bfloat16), x)


@pytest.mark.parametrize("compiled", [True, False], ids=["weight-kernels", "weight-reference"])
def test_the_reference_transforms_compose_to_a_convolution_in_float64(compiled: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The algebra itself: reference tiles, weight tiles and products give ``F.conv2d``, its input gradient and its
    weight gradient to float64 rounding (odd sizes: the last tile row and column are partial). The weight transforms
    run as the C++ kernels and as their reference."""
    _use_kernels(compiled, monkeypatch)
    x, weight = _randn(2, 3, 5, 7, dtype=torch.float64), _randn(4, 3, 3, 3, dtype=torch.float64, seed=1)
    grad = _randn(2, 4, 5, 7, dtype=torch.float64, seed=2)
    out = _reference_output(torch.bmm(_reference_tiles("winograd_input_tiles_", x), winograd_weight_tiles(weight)),
                            2, 5, 7, None)
    torch.testing.assert_close(out, F.conv2d(x, weight, padding=1), atol=1e-12, rtol=1e-12)
    grad_x = _reference_output(torch.bmm(_reference_tiles("winograd_input_tiles_", grad),
                                         winograd_weight_tiles(weight, transposed=True)), 2, 5, 7, None)
    leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
    expected = torch.autograd.grad(F.conv2d(*leaves, padding=1), leaves, grad)
    torch.testing.assert_close(grad_x, expected[0], atol=1e-12, rtol=1e-12)
    products = torch.bmm(_reference_tiles("winograd_gradient_tiles_", grad).transpose(1, 2),
                         _reference_tiles("winograd_input_tiles_", x))
    torch.testing.assert_close(winograd_weight_gradient(products, weight), expected[1], atol=1e-12, rtol=1e-12)


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"winograd_input_tiles: input must be a floating \[N, C, H, W\]"):
        winograd_input_tiles(torch.zeros(3, 4, 5))
    with pytest.raises(ValueError, match=r"winograd_output: products must be \[16, 6, C\] for a \[1, C, 3, 5\] map"):
        winograd_output(torch.zeros(16, 5, 2), 1, 3, 5)
    with pytest.raises(ValueError, match=r"winograd_output_: bias must be \[2\]"):
        winograd_output(torch.zeros(16, 6, 2), 1, 3, 5, torch.zeros(3))
    with pytest.raises(ValueError, match=r"weight must be \[C_out, C_in, 3, 3\]"):
        winograd_weight_tiles(torch.zeros(2, 2, 5, 5))
    with pytest.raises(ValueError, match=r"winograd_conv3x3 needs x \[N, C_in, H, W\] and weight"):
        winograd_conv3x3(torch.zeros(1, 3, 4, 4), torch.zeros(2, 4, 3, 3))


@needs_ext
def test_fake_kernels_accept_the_calls() -> None:
    """The in-place ops under FakeTensorMode (torch.compile's tracing): they check nothing and return nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 8, 5, 7)
        tiles = torch.empty(16, 2 * 3 * 4, 8)
        assert torch.ops.lit_amp_det.winograd_input_tiles_(tiles, x, 0) is None
        assert torch.ops.lit_amp_det.winograd_gradient_tiles_(tiles[:, 3:10], x, 3) is None
        out = torch.empty(2, 8, 5, 7).contiguous(memory_format=NHWC)
        assert torch.ops.lit_amp_det.winograd_output_(out, tiles, None, 0) is None


# ------------------------------------------------------------------------------------------- the convolution

def _conv_inputs(n: int, c_in: int, c_out: int, size: tuple[int, int], dtype: torch.dtype, seed: int = 0):
    x = _randn(n, c_in, *size, dtype=torch.float32, seed=seed).to(dtype).contiguous(memory_format=NHWC)
    w = (_randn(c_out, c_in, 3, 3, seed=seed + 1) / (3 * c_in ** 0.5)).to(dtype)
    b = _randn(c_out, seed=seed + 2).to(dtype)
    return x, w, b


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("size", [(14, 14), (5, 7), (1, 1)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_conv_matches_conv2d_to_rounding(size: tuple[int, int], dtype: torch.dtype) -> None:
    x, w, b = _conv_inputs(3, 6, 5, size, dtype)
    out = winograd_conv3x3(x, w, b)
    assert out.dtype == dtype and out.is_contiguous(memory_format=NHWC)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out, F.conv2d(x, w, b, padding=1), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_error_is_bounded(dtype: torch.dtype) -> None:
    """Against a float64 convolution of the same half-precision operands: 0.5 % relative error measured in bf16 (3x
    oneDNN's direct bf16 convolution, both near bf16's 0.39 % unit roundoff); bounded here at 1 % (bf16) and 0.15 %
    (fp16, 8x finer), forward and both gradients."""
    x, w, b = _conv_inputs(6, 64, 48, (14, 14), dtype)
    grad = _randn(6, 48, 14, 14, dtype=torch.float32, seed=5).to(dtype).contiguous(memory_format=NHWC)
    bound = 1e-2 if dtype == torch.bfloat16 else 1.5e-3
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]
    out = winograd_conv3x3(*leaves)
    ours = [out, *torch.autograd.grad(out, leaves, grad)]
    exact = [t.double().requires_grad_() for t in (x, w, b)]
    ref_out = F.conv2d(*exact, padding=1)
    expected = [ref_out, *torch.autograd.grad(ref_out, exact, grad.double())]
    for name, actual, wanted in zip(("output", "input grad", "weight grad", "bias grad"), ours, expected):
        assert actual.dtype == dtype
        assert _relative_error(actual, wanted.detach()) < bound, name


def test_chunked_convolution_equals_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """With chunks of 5 tiles (uneven, across image boundaries) the output and all gradients are the same."""
    x, w, b = _conv_inputs(3, 4, 5, (5, 7), torch.float64)
    grad = _randn(3, 5, 5, 7, dtype=torch.float64, seed=4)

    def run() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        out = winograd_conv3x3(*leaves)
        return [out, *torch.autograd.grad(out, leaves, grad)]

    whole = run()
    monkeypatch.setattr("lit_amp_det.models.winograd_conv.CHUNK_TILES", 5)
    chunked = run()
    torch.testing.assert_close(chunked, whole, atol=1e-12, rtol=1e-12)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    expected = F.conv2d(*leaves, padding=1)
    torch.testing.assert_close(chunked, [expected, *torch.autograd.grad(expected, leaves, grad)],
                               atol=1e-12, rtol=1e-12)


def test_overlapping_last_chunk_equals_conv2d(monkeypatch: pytest.MonkeyPatch) -> None:
    """36 tiles in chunks of 8 with a granule of 3: the last chunk (6 tiles) starts 2 tiles inside the one before.
    Output and all gradients equal F.conv2d's in float64: the overlapping tiles are written twice and their weight
    gradient counted once."""
    from lit_amp_det.models import winograd_conv

    monkeypatch.setattr(winograd_conv, "CHUNK_TILES", 8)
    monkeypatch.setattr(winograd_conv, "TILE_GRANULE", 3)
    assert winograd_conv._chunks(tile_count(3, 5, 7))[-1] == (30, 36, 2)
    _assert_equals_conv2d_in_float64(3, (5, 7), output_tile=2)


def _assert_equals_conv2d_in_float64(n: int, size: tuple[int, int], output_tile: int) -> None:
    """``winograd_conv3x3`` of an N x 4 x H x W float64 input (4 -> 5 channels, with bias): output and every gradient
    equal ``F.conv2d``'s to 1e-12."""
    x, w, b = _conv_inputs(n, 4, 5, size, torch.float64)
    grad = _randn(n, 5, *size, dtype=torch.float64, seed=4)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    out = winograd_conv3x3(*leaves, output_tile=output_tile)
    ours = [out, *torch.autograd.grad(out, leaves, grad)]
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    expected = F.conv2d(*leaves, padding=1)
    torch.testing.assert_close(ours, [expected, *torch.autograd.grad(expected, leaves, grad)],
                               atol=1e-12, rtol=1e-12)


@needs_ext
def test_matrix_products_take_few_shapes_whatever_the_roi_count() -> None:
    """A training step's mask-head tile count changes with its RoI count; oneDNN keeps every bf16 matmul shape it
    has seen (about 0.5 MB each, up to ~540 MB). Forward and backward over 40 RoI counts (1029 to 2940 tiles of
    14x14 maps) use at most CHUNK_TILES / TILE_GRANULE + 1 shapes of each of the three products."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from lit_amp_det.models import winograd_conv

    shapes: set[tuple[tuple[int, ...], ...]] = set()

    class RecordProducts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.bmm.out, torch.ops.aten.baddbmm.default,
                        torch.ops.aten.baddbmm.out):
                shapes.add(tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
            return func(*args, **(kwargs or {}))

    weight = _randn(8, 8, 3, 3, dtype=torch.bfloat16, seed=1).requires_grad_()
    with RecordProducts():
        for rois in range(21, 61):
            x = _randn(rois, 8, 14, 14, dtype=torch.bfloat16, seed=rois).requires_grad_()
            out = winograd_conv3x3(x, weight)
            torch.autograd.grad(out, (x, weight), torch.ones_like(out))
    per_product = -(-winograd_conv.CHUNK_TILES // winograd_conv.TILE_GRANULE) + 1
    assert len(shapes) <= 3 * per_product, sorted(shapes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_buffers_are_reused_and_never_returned(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """The convolution's temporaries persist from call to call (no allocation per call but the results) and the
    results are tensors of their own: a later call does not change an earlier output or gradient.
    release_workspace() frees them. In bf16 the weight gradient's products are summed in an fp32 buffer."""
    from lit_amp_det.models import winograd_conv

    monkeypatch.setattr(winograd_conv, "CHUNK_TILES", 4)
    x, w, b = (t.to(dtype) for t in _conv_inputs(2, 3, 4, (5, 6), torch.float32))
    winograd_conv.release_workspace()

    def call(image: torch.Tensor) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (image, w, b)]
        out = winograd_conv3x3(*leaves)
        return [out, *torch.autograd.grad(out, leaves, torch.ones_like(out))]

    first = call(x)
    kept = [t.clone() for t in first]
    pointers = {key: t.data_ptr() for key, t in winograd_conv._WORKSPACE.buffers.items()}
    expected = {("tiles", dtype), ("products", dtype), ("filters", dtype), ("weight_sum", torch.float32)}
    if dtype != torch.float32:
        expected.add(("weight", dtype))
    assert {(slot, slot_dtype) for slot, slot_dtype, _ in pointers} == expected
    second = call(x.flip(0) + 1)
    assert {key: t.data_ptr() for key, t in winograd_conv._WORKSPACE.buffers.items()} == pointers
    for result, kept_copy in zip(first, kept):
        assert torch.equal(result, kept_copy)
    winograd_conv.release_workspace()
    assert not winograd_conv._WORKSPACE.buffers
    for reused, fresh in zip(second, call(x.flip(0) + 1)):  # nothing of the first call leaks into the second
        assert torch.equal(reused, fresh)


@needs_ext
def test_a_layer_trains_after_calls_under_inference_mode() -> None:
    """Lightning validates under torch.inference_mode (the sanity check runs before the first training step), and
    buffers made there are inference tensors, which may not be written outside it: training after them failed in
    its first Winograd layer ("Inplace update to inference tensor outside InferenceMode"). The buffers are made
    again outside inference mode, and serve both modes from then on."""
    from lit_amp_det.models import winograd_conv

    winograd_conv.release_workspace()
    layer = _switched_layer(64).to(memory_format=NHWC)
    x = _randn(1, 64, 32, 32).contiguous(memory_format=NHWC)
    with torch.inference_mode():
        evaluated = layer(x)
    assert all(t.is_inference() for t in winograd_conv._WORKSPACE.buffers.values())
    trained = layer(x.clone().requires_grad_())
    trained.square().sum().backward()
    assert not any(t.is_inference() for t in winograd_conv._WORKSPACE.buffers.values())
    pointers = {key: t.data_ptr() for key, t in winograd_conv._WORKSPACE.buffers.items()}
    with torch.inference_mode():  # a normal buffer serves inference mode as it is
        again = layer(x)
    assert {key: t.data_ptr() for key, t in winograd_conv._WORKSPACE.buffers.items()} == pointers
    assert torch.equal(evaluated, trained.detach()) and torch.equal(again, evaluated)
    assert layer.weight.grad is not None


def test_weight_tiles_out_must_match() -> None:
    """winograd_weight_tiles(out=) writes into a contiguous [16, C_in, C_out] tensor of the weight's dtype
    ([16, C_out, C_in] with transposed=True) and refuses any other, naming the shape it needs."""
    weight = _randn(4, 3, 3, 3, dtype=torch.float32, seed=5)
    for transposed, shape in ((False, (16, 3, 4)), (True, (16, 4, 3))):
        out = torch.empty(shape)
        tiles = winograd_weight_tiles(weight, transposed=transposed, out=out)
        assert tiles is out
        torch.testing.assert_close(tiles, winograd_weight_tiles(weight, transposed=transposed), atol=0, rtol=0)
        other = (shape[0], shape[2], shape[1])
        for bad in (torch.empty(other), torch.empty(shape, dtype=torch.float64), torch.empty(other).mT):
            with pytest.raises(ValueError, match=rf"out must be a contiguous \[16, {shape[1]}, {shape[2]}\]"):
                winograd_weight_tiles(weight, transposed=transposed, out=bad)


# ------------------------------------------------------------------------------------------- the weight transforms

#: [C_out, C_in]: counts ragged against the weight-tile kernel's blocks (16 rows of 32 filters), a block exactly, one
#: filter, more rows than columns
WEIGHTS = [(70, 33), (32, 16), (1, 1), (130, 5)]


def _weight_layouts(weight: torch.Tensor) -> list[torch.Tensor]:
    """``weight`` contiguous, channels_last, and as a strided view (every other input channel of a wider tensor)."""
    wide = torch.zeros(weight.shape[0], 2 * weight.shape[1], 3, 3, dtype=weight.dtype)
    wide[:, ::2] = weight
    return [weight.contiguous(), weight.contiguous(memory_format=NHWC), wide[:, ::2]]


@needs_ext
@pytest.mark.parametrize("output_tile", [2, 4], ids=["F2", "F4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", WEIGHTS, ids=str)
def test_weight_tiles_op_matches_the_reference(output_tile: int, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """G w G^T of every filter, [positions, C_in, C_out] (transposed: of the rotated filters, [positions, C_out,
    C_in]), from the weight in any memory format, to the rounding of the dtype."""
    weight = _randn(*shape, 3, 3, dtype=dtype, seed=3)
    positions = 16 if output_tile == 2 else 36
    for transposed in (False, True):
        expected = torch.empty(positions, *(shape if transposed else shape[::-1]), dtype=dtype)
        reference.winograd_weight_tiles_(expected, weight, transposed)
        for layout in _weight_layouts(weight):
            tiles = winograd_weight_tiles(layout, transposed=transposed, output_tile=output_tile)
            assert tiles.shape == expected.shape and tiles.dtype == dtype and tiles.is_contiguous()
            _close_to_rounding(tiles, expected, weight)


@needs_ext
@pytest.mark.parametrize("output_tile", [2, 4], ids=["F2", "F4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", WEIGHTS, ids=str)
def test_weight_gradient_op_matches_the_reference(output_tile: int, dtype: torch.dtype,
                                                  shape: tuple[int, int]) -> None:
    """A'^T s A' of every filter's summed products (fp32; fp64 for fp64) into a gradient of the weight's dtype and
    memory format, to the rounding of the dtype (the back transform's coefficients reach 16: compared against the
    result's scale)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    products = _randn(16 if output_tile == 2 else 36, *shape, dtype=acc, seed=4)
    expected = torch.empty(*shape, 3, 3, dtype=dtype)
    reference.winograd_weight_gradient_(expected, products)
    for like in _weight_layouts(torch.zeros(*shape, 3, 3, dtype=dtype)):
        grad = winograd_weight_gradient(products, like)
        assert grad.dtype == dtype and grad.stride() == torch.empty_like(like).stride()
        _close_to_rounding(grad, expected, expected)
    holder = torch.full((shape[0], 2 * shape[1], 3, 3), float("nan"), dtype=dtype)
    out = holder[:, ::2]  # written through its own strides, nothing in between
    assert winograd_weight_gradient(products, out, out=out) is out
    _close_to_rounding(out, expected, expected)
    assert holder[:, 1::2].isnan().all()


@needs_ext
@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0, 0)], ids=str)
def test_weight_transforms_of_empty_weights(shape: tuple[int, int]) -> None:
    weight = torch.zeros(*shape, 3, 3)
    for output_tile, positions in ((2, 16), (4, 36)):
        assert winograd_weight_tiles(weight, output_tile=output_tile).shape == (positions, shape[1], shape[0])
        assert winograd_weight_tiles(weight, True, output_tile=output_tile).shape == (positions, *shape)
        products = torch.zeros(positions, *shape)
        assert winograd_weight_gradient(products, weight).shape == weight.shape


def test_weight_transforms_name_the_bad_argument() -> None:
    weight = torch.zeros(4, 3, 3, 3)
    with pytest.raises(ValueError, match=r"winograd_weight_tiles: weight must be \[C_out, C_in, 3, 3\] and floating "
                                         r"point, got torch.int64"):
        winograd_weight_tiles(torch.zeros(4, 3, 3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"winograd_weight_gradient: products must be \[16, 4, 3\] for a "
                                         r"\(4, 3, 3, 3\) weight, got \(16, 3, 4\)"):
        winograd_weight_gradient(torch.zeros(16, 3, 4), weight)
    with pytest.raises(ValueError, match=r"winograd_weight_gradient: like must be \[C_out, C_in, 3, 3\]"):
        winograd_weight_gradient(torch.zeros(16, 4, 3), torch.zeros(4, 3, 5, 5))
    for bad in (torch.zeros(4, 3, 3, 3, dtype=torch.float64), torch.zeros(3, 4, 3, 3)):
        with pytest.raises(ValueError, match=r"winograd_weight_gradient: out must be a \(4, 3, 3, 3\) torch.float32 "
                                             r"tensor like the weight"):
            winograd_weight_gradient(torch.zeros(16, 4, 3), weight, out=bad)


@needs_ext
def test_weight_kernels_check_their_arguments() -> None:
    """The ops themselves refuse what the wrappers never pass, naming the argument."""
    weight = torch.zeros(4, 3, 3, 3)
    with pytest.raises(RuntimeError, match=r"winograd_weight_tiles_: tiles must be a contiguous \[16, 3, 4\] tensor"):
        torch.ops.lit_amp_det.winograd_weight_tiles_(torch.zeros(16, 4, 3), weight, False)
    with pytest.raises(RuntimeError, match=r"winograd_weight_tiles_: tiles must be \[16, ...\] \(F\(2x2, 3x3\)\)"):
        torch.ops.lit_amp_det.winograd_weight_tiles_(torch.zeros(25, 3, 4), weight, False)
    with pytest.raises(RuntimeError, match="winograd_weight_tiles_: tiles are BFloat16 but the weight is Float"):
        torch.ops.lit_amp_det.winograd_weight_tiles_(torch.zeros(16, 3, 4, dtype=torch.bfloat16), weight, False)
    with pytest.raises(RuntimeError, match=r"winograd_weight_gradient_: products must be Float \(what a BFloat16 "
                                           r"gradient is summed in\), got BFloat16"):
        torch.ops.lit_amp_det.winograd_weight_gradient_(weight.bfloat16(), torch.zeros(16, 4, 3, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"winograd_weight_gradient_: products must be a contiguous \[16, 4, 3\]"):
        torch.ops.lit_amp_det.winograd_weight_gradient_(weight, torch.zeros(16, 3, 4).mT)
    with pytest.raises(RuntimeError, match=r"winograd_weight_gradient_: grad_weight must be \[C_out, C_in, 3, 3\]"):
        torch.ops.lit_amp_det.winograd_weight_gradient_(torch.zeros(4, 3, 2, 2), torch.zeros(16, 4, 3))


@needs_ext
def test_weight_ops_opcheck() -> None:
    """torch.library.opcheck of the weight transforms (schemas, fake kernels, dispatch), both tile sizes."""
    weight = _randn(5, 3, 3, 3).contiguous(memory_format=NHWC)
    for positions in (16, 36):
        for transposed, shape in ((False, (positions, 3, 5)), (True, (positions, 5, 3))):
            torch.library.opcheck(torch.ops.lit_amp_det.winograd_weight_tiles_.default,
                                  (torch.empty(shape), weight, transposed))
        torch.library.opcheck(torch.ops.lit_amp_det.winograd_weight_gradient_.default,
                              (torch.empty_like(weight), _randn(positions, 5, 3)))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("size", [(4, 6), (5, 3)], ids=str)
def test_gradcheck_float64(bias: bool, size: tuple[int, int]) -> None:
    x, w, b = _conv_inputs(2, 3, 4, size, torch.float64)
    args = [x.requires_grad_(), w.requires_grad_(), b.requires_grad_() if bias else None]
    assert torch.autograd.gradcheck(winograd_conv3x3, args)


@pytest.mark.parametrize("wanted", [(True, False, False), (False, True, False), (False, False, True)], ids=str)
def test_each_gradient_alone(wanted: tuple[bool, bool, bool]) -> None:
    x, w, b = _conv_inputs(2, 4, 3, (6, 5), torch.float64)
    leaves = [t.clone().requires_grad_(flag) for t, flag in zip((x, w, b), wanted)]
    grad = _randn(2, 3, 6, 5, dtype=torch.float64, seed=3)
    asked = [t for t in leaves if t.requires_grad]
    ours = torch.autograd.grad(winograd_conv3x3(*leaves), asked, grad)
    expected = torch.autograd.grad(F.conv2d(*leaves, padding=1), asked, grad)
    torch.testing.assert_close(ours, expected, atol=1e-12, rtol=1e-12)


def test_double_backward_is_refused() -> None:
    x, w, b = (t.requires_grad_() for t in _conv_inputs(1, 2, 2, (4, 4), torch.float64))
    with pytest.raises(RuntimeError, match="winograd_conv3x3 is differentiable once"):
        torch.autograd.grad(winograd_conv3x3(x, w, b).sum(), x, create_graph=True)


def test_autocast_casts_like_conv2d() -> None:
    x, w, b = _conv_inputs(2, 8, 6, (6, 6), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = winograd_conv3x3(x, w, b), F.conv2d(x, w, b, padding=1)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=5e-2, rtol=2e-2)


@needs_ext
def test_r50_mask_head_size_in_bf16() -> None:
    """The layer the switch is for: 70 RoIs of [256, 14, 14], forward and weight gradient within 1 % of float64."""
    x, w, b = _conv_inputs(70, 256, 256, (14, 14), torch.bfloat16)
    leaves = [w.detach().requires_grad_()]
    out = winograd_conv3x3(x, leaves[0], b)
    grad = torch.ones_like(out)
    (grad_w,) = torch.autograd.grad(out, leaves, grad)
    exact_w = w.double().requires_grad_()
    expected = F.conv2d(x.double(), exact_w, b.double(), padding=1)
    (expected_grad_w,) = torch.autograd.grad(expected, exact_w, grad.double())
    assert _relative_error(out, expected.detach()) < 1e-2
    assert _relative_error(grad_w, expected_grad_w) < 1e-2


# ------------------------------------------------------------------------------------------- the layer

@pytest.mark.parametrize(("kwargs", "expected"), [
    ({}, True), ({"stride": 2}, False), ({"padding": 0}, False), ({"dilation": 2, "padding": 2}, False),
    ({"groups": 2}, False), ({"padding_mode": "reflect"}, False), ({"padding": "same"}, True),
], ids=str)
def test_winograd_shapes(kwargs: dict, expected: bool) -> None:
    assert is_winograd_shape(nn.Conv2d(4, 4, 3, **{"padding": 1, **kwargs})) is expected


def _switched_layer(channels: int) -> WinogradConv2d:
    conv = nn.Conv2d(channels, channels, 3, padding=1)
    conv.__class__ = WinogradConv2d
    return conv


def _switched_layer_without_bias(channels: int) -> WinogradConv2d:
    conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
    conv.__class__ = WinogradConv2d
    return conv


@needs_ext
def test_layer_takes_winograd_only_where_measured_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_model, "splits_512_bit_vectors", lambda: False)  # a full-width CPU (Zen 5, AVX2 hosts)
    conv = _switched_layer(256)
    big = torch.zeros(1, 256, 64, 64)  # 32 x 32 = 1024 tiles
    assert MIN_TILES == 1024
    assert conv.computes_with_winograd(big.bfloat16()) and conv.computes_with_winograd(big.half())
    assert conv.computes_with_winograd(big)  # float32, large enough: see the fp32 sizes below
    assert not conv.computes_with_winograd(big.double())  # float64: the direct convolution
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv.computes_with_winograd(big)
    assert not conv.computes_with_winograd(torch.zeros(1, 256, 62, 62, dtype=torch.bfloat16))  # 961 tiles
    assert not _switched_layer(128).computes_with_winograd(torch.zeros(1, 128, 64, 64, dtype=torch.bfloat16))
    assert not conv.computes_with_winograd(torch.zeros(256, 64, 64, dtype=torch.bfloat16))  # unbatched


@needs_ext
def test_a_cpu_that_splits_512_bit_vectors_takes_half_layers_from_fewer_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    # Zen 4: the tiles paid from 128 of them at 256 and 512 channels (bf16), never at 128 channels
    monkeypatch.setattr(cpu_model, "splits_512_bit_vectors", lambda: True)
    assert half_min_tiles() == SPLIT_VECTOR_MIN_TILES == 128
    conv = _switched_layer(256)
    assert conv.computes_with_winograd(torch.zeros(2, 256, 16, 16, dtype=torch.bfloat16))  # 128 tiles
    assert conv.computes_with_winograd(torch.zeros(2, 256, 16, 16, dtype=torch.half))
    assert not conv.computes_with_winograd(torch.zeros(1, 256, 16, 16, dtype=torch.bfloat16))  # 64 tiles
    assert not _switched_layer(128).computes_with_winograd(torch.zeros(1, 128, 64, 64, dtype=torch.bfloat16))
    # float32 keeps its own rule (measured on an AVX2 CPU): 128 channels x 128 tiles is 16384 channel-tiles
    assert _switched_layer(128).computes_with_winograd(torch.zeros(2, 128, 16, 16))
    assert not _switched_layer(128).computes_with_winograd(torch.zeros(2, 128, 16, 16, dtype=torch.bfloat16))
    monkeypatch.setattr(cpu_model, "splits_512_bit_vectors", lambda: False)
    assert half_min_tiles() == MIN_TILES
    assert not conv.computes_with_winograd(torch.zeros(2, 256, 16, 16, dtype=torch.bfloat16))


@needs_ext
@pytest.mark.parametrize(("channels", "n", "size", "expected"), [
    (512, 4, 7, True),     # 64 tiles (ResNet-18 layer4, 224 px b4): 1.58-1.74x
    (256, 1, 16, True),    # 64 tiles: 1.73-1.89x
    (128, 2, 16, True),    # 128 tiles: 1.17-1.21x
    (128, 1, 16, False),   # 64 tiles: 0.94-1.14x, below 16384 channel-tiles
    (64, 1, 32, True),     # 256 tiles: 1.14-1.23x
    (64, 4, 14, False),    # 196 tiles: 0.85-1.03x
    (64, 2, 16, False),    # 128 tiles: 1.00-1.04x
    (32, 4, 28, False),    # 784 tiles: 0.90x at best
    (512, 2, 8, False),    # 32 tiles: below the 64-tile floor, the smallest count measured
], ids=str)
def test_float32_takes_winograd_where_measured_faster(channels: int, n: int, size: int, expected: bool) -> None:
    """The fp32 size rule, at the sizes it was measured at (AVX2 CPU, forward + backward, two in-process sweeps;
    FP32_MIN_* in the module)."""
    conv = _switched_layer(channels)
    assert conv.computes_with_winograd(torch.zeros(n, channels, size, size)) is expected
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert conv.computes_with_winograd(torch.zeros(n, channels, size, size)) is expected


@needs_ext
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_float32_layer_equals_conv2d_at_a_real_size(bias: bool) -> None:
    """The R50-FPN mask head's 256-channel layer on 20 RoIs (980 tiles), forward and every gradient, in float32:
    within 1e-5 of the largest value against a float64 convolution, as close as oneDNN's own fp32 convolution."""
    plain = nn.Conv2d(256, 256, 3, padding=1, bias=bias)
    switched = _switched_layer(256) if bias else _switched_layer_without_bias(256)
    switched.load_state_dict(plain.state_dict())
    x = _randn(20, 256, 14, 14, dtype=torch.float32, seed=3).contiguous(memory_format=NHWC)
    assert switched.computes_with_winograd(x)
    grad = _randn(20, 256, 14, 14, dtype=torch.float32, seed=4)
    exact_layer = copy.deepcopy(plain).double()

    def run(layer: nn.Module, inputs: torch.Tensor) -> list[torch.Tensor]:
        leaf = inputs.detach().requires_grad_()
        out = layer(leaf)
        out.backward(grad.to(out.dtype))
        return [out.detach(), leaf.grad, *[p.grad for p in layer.parameters()]]

    results = [run(switched, x), run(plain, x), run(exact_layer, x.double())]
    ours, onednn, exact = results
    for name, a, b, e in zip(("output", "input grad", "weight grad", "bias grad"), ours, onednn, exact):
        scale = e.abs().max().item()
        ours_error = (a.double() - e).abs().max().item() / scale
        onednn_error = (b.double() - e).abs().max().item() / scale
        assert ours_error < 1e-5, name
        assert ours_error < 2 * onednn_error + 1e-7, name


@needs_ext
def test_layer_equals_conv2d_and_keeps_its_state_dict() -> None:
    plain = nn.Conv2d(256, 256, 3, padding=1).bfloat16()
    switched = _switched_layer(256).bfloat16()
    switched.load_state_dict(plain.state_dict())
    assert list(switched.state_dict()) == list(plain.state_dict())
    x = torch.randn(1, 256, 64, 64).bfloat16().contiguous(memory_format=NHWC)
    torch.testing.assert_close(switched(x).float(), plain(x).float(), atol=6e-2, rtol=5e-2)
    small = x[:, :, :8, :8]  # below MIN_TILES: the plain convolution itself
    assert torch.equal(switched(small), plain(small))


@needs_ext
def test_conv_bn_eval_folds_through_the_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A switched conv followed by a BatchNorm in eval mode is still a foldable pair, and the folded weight goes
    through :meth:`WinogradConv2d.convolve` (the Winograd path: 1024 tiles, bf16)."""
    def net() -> nn.Sequential:
        torch.manual_seed(0)
        seq = nn.Sequential(nn.Conv2d(256, 256, 3, padding=1, bias=False), nn.BatchNorm2d(256))
        seq[1].running_mean.uniform_(-1, 1), seq[1].running_var.uniform_(0.5, 2)
        return seq.bfloat16().eval()

    plain, switched = net(), net()
    switched[0].__class__ = WinogradConv2d
    assert find_conv_norm_pairs(switched) == find_conv_norm_pairs(plain) == [("0", "1")]
    for model in (plain, switched):
        assert enable_conv_bn_eval(model, only_when_cheaper=False)
    x = torch.randn(1, 256, 64, 64).bfloat16().contiguous(memory_format=NHWC)
    calls = []
    original = WinogradConv2d.convolve

    def spy(self, *args):
        calls.append(self.computes_with_winograd(args[0]))
        return original(self, *args)

    monkeypatch.setattr(WinogradConv2d, "convolve", spy)
    out = switched(x)
    monkeypatch.undo()
    assert calls == [True]
    torch.testing.assert_close(out.float(), plain(x).float(), atol=1e-1, rtol=5e-2)


def _tiny_module(*overrides: str):
    cfg = compose_config(["model=maskrcnn_tiny", "model.num_classes=3", *overrides])
    return instantiate(cfg.model, _convert_="object")


def test_model_switch_covers_the_named_parts_and_keeps_state_dict() -> None:
    plain = _tiny_module()
    switched = _tiny_module("model.winograd_convs=[mask_head,rpn_head]")
    heads = [m for m in switched.model.roi_heads.mask_head.modules() if isinstance(m, WinogradConv2d)]
    rpn = [m for m in switched.model.rpn.head.modules() if isinstance(m, WinogradConv2d)]
    assert heads and rpn and all(is_winograd_shape(m) for m in heads + rpn)
    assert not any(isinstance(m, WinogradConv2d) for m in switched.model.backbone.modules())
    assert list(switched.state_dict()) == list(plain.state_dict())
    assert find_conv_norm_pairs(switched.model) == find_conv_norm_pairs(plain.model)


@needs_ext
@pytest.mark.parametrize(("output_tile", "output_tol", "grad_tol"), [(2, 1e-5, 1e-4), (4, 1e-4, 4e-4)],
                         ids=["F(2x2)", "F(4x4)"])
def test_float32_parts_equal_direct_convolutions_forward_and_backward(
        monkeypatch: pytest.MonkeyPatch, output_tile: int, output_tol: float, grad_tol: float) -> None:
    """Every part's 3x3 layers on Winograd tiles in fp32 (the size rule lowered so that the tiny model's 16-32
    channel layers take them): the backbone + FPN, the RPN head and the mask head give the direct model's outputs and
    every parameter's gradient to fp32 rounding, so in fp32 the switch changes speed, not training. (A whole detector
    step is not compared: its proposal top-k, NMS and sampling turn rounding differences into different choices.)
    ``model.winograd_output_tile=4`` through the config: every layer on F(4x4) tiles, within its larger rounding."""
    from lit_amp_det.models import winograd_conv

    monkeypatch.setattr(winograd_conv, "FP32_MIN_CHANNELS", 1)
    monkeypatch.setattr(winograd_conv, "FP32_MIN_TILES", 1)
    monkeypatch.setattr(winograd_conv, "FP32_MIN_CHANNEL_TILES", 1)
    monkeypatch.setattr(winograd_conv, "F4_MIN_TILES", 1)  # F(4x4) on the small maps too
    torch.manual_seed(0)
    plain = _tiny_module("model.channels_last=true")
    switched = _tiny_module("model.channels_last=true", "model.winograd_convs=[mask_head,rpn_head,fpn,backbone]",
                            f"model.winograd_output_tile={output_tile}")
    switched.load_state_dict(plain.state_dict())
    for module in (plain, switched):  # no ReLU kink for a rounding difference to flip (see smooth_activations)
        smooth_activations(module).train()
    layers = [m for m in switched.modules() if isinstance(m, WinogradConv2d)]
    assert len(layers) >= 8 and all(m.output_tile == output_tile for m in layers)
    g = torch.Generator().manual_seed(1)
    images = torch.rand(2, 3, 160, 160, generator=g).contiguous(memory_format=NHWC)
    rois = torch.randn(12, 32, 14, 14, generator=g).contiguous(memory_format=NHWC)

    def run(module: nn.Module) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        module.zero_grad()
        detector = module.model
        features = list(detector.backbone(images).values())
        objectness, deltas = detector.rpn.head(features)
        masks = detector.roi_heads.mask_head(rois)
        outputs = [*features, *objectness, *deltas, masks]
        weights = torch.Generator().manual_seed(3)
        loss = sum((out * torch.randn(out.shape, generator=weights)).sum() for out in outputs)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}
        return [out.detach() for out in outputs], grads

    called = []
    original = winograd_conv.winograd_conv3x3
    monkeypatch.setattr(winograd_conv, "winograd_conv3x3", lambda *a: called.append(a[3]) or original(*a))
    outputs, grads = run(switched)
    assert len(called) >= len(layers) and set(called) == {output_tile}  # every switched layer ran on its tiles
    monkeypatch.setattr(winograd_conv, "winograd_conv3x3", original)
    expected_outputs, expected_grads = run(plain)
    for out, expected in zip(outputs, expected_outputs, strict=True):
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=output_tol * expected.abs().max().item())
    assert grads.keys() == expected_grads.keys() and len(grads) > 40
    for name, grad in grads.items():
        reference = expected_grads[name]
        assert (grad - reference).norm() <= grad_tol * reference.norm() + 1e-7, name


def test_unknown_part_is_refused_and_a_missing_one_skipped() -> None:
    with pytest.raises(ValueError, match=r"model.winograd_convs: unknown part\(s\) \['mask_heads'\]"):
        use_winograd_convs(nn.Module(), ["mask_heads"])
    faster = _tiny_module("model.mask=false")
    assert use_winograd_convs(faster.model, ["mask_head"]) == 0
    assert use_winograd_convs(faster.model, ["mask_head", "rpn_head"]) == 1


def test_module_warns_when_the_switch_finds_no_layer(caplog: pytest.LogCaptureFixture) -> None:
    """A Faster R-CNN has no mask head: ``model.winograd_convs=[mask_head]`` switches nothing, and says so."""
    with caplog.at_level("WARNING", logger="lit_amp_det.module"):
        _tiny_module("model.mask=false", "model.winograd_convs=[mask_head]")
    assert "model.winograd_convs=['mask_head']: the model has no 3x3, stride-1 convolution there" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="lit_amp_det.module"):
        _tiny_module("model.mask=false", "model.winograd_convs=[rpn_head]")
    assert "winograd_convs" not in caplog.text


def test_config_default_is_none() -> None:
    assert list(compose_config([]).model.winograd_convs) == []


@needs_ext
def test_opcheck() -> None:
    """torch.library.opcheck: the schemas' mutation annotations, the fake kernels and dispatch agree with the
    kernels."""
    x = _randn(2, 3, 5, 7)
    torch.library.opcheck(torch.ops.lit_amp_det.winograd_input_tiles_.default, (torch.empty(16, 7, 3), x, 5))
    torch.library.opcheck(torch.ops.lit_amp_det.winograd_gradient_tiles_.default, (torch.empty(16, 24, 3), x, 0))
    out = torch.zeros(2, 3, 5, 7).contiguous(memory_format=NHWC)
    torch.library.opcheck(torch.ops.lit_amp_det.winograd_output_.default, (out, _randn(16, 10, 3), _randn(3), 4))


@needs_ext
@pytest.mark.parametrize(("dtype", "channels", "size", "output_tile"), [(torch.bfloat16, 256, 64, 2),
                                                                       (torch.float32, 128, 32, 4)],
                         ids=["bf16 F(2x2)", "fp32 F(4x4)"])
def test_compiles_in_one_graph(dtype: torch.dtype, channels: int, size: int, output_tile: int) -> None:
    """``model.compile=backbone`` with Winograd FPN layers: torch.compile traces the layer's Winograd path (the
    size rule, the in-place ops through their fake kernels into buffers of the graph's own) into one graph, forward
    and backward, and gives the eager layer's values exactly (so it did not fall back to oneDNN, whose values
    differ); with F(2x2) tiles in bf16 and F(4x4) tiles in fp32."""
    conv = nn.Conv2d(channels, channels, 3, padding=1).to(dtype).to(memory_format=torch.channels_last)
    conv.__class__ = WinogradConv2d
    conv.output_tile = output_tile
    x = _randn(1, channels, size, size, dtype=dtype, seed=6).contiguous(memory_format=torch.channels_last)
    assert conv.computes_with_winograd(x) and conv.tile_side(x) == output_tile

    def step(layer: nn.Module) -> list[torch.Tensor]:
        image = x.clone().requires_grad_()
        out = layer(image).relu()
        return [out.detach(), *torch.autograd.grad(out.sum(), [image, conv.weight, conv.bias])]

    eager = _same_eager_and_compiled(step, conv)
    direct = F.conv2d(x, conv.weight, conv.bias, padding=1).relu()
    assert not torch.equal(eager[0], direct)


def _same_eager_and_compiled(step: Callable[[nn.Module], list[torch.Tensor]], layer: nn.Module) -> list[torch.Tensor]:
    """Runs ``step`` with ``layer`` and with ``torch.compile(layer)`` (``aot_eager``, one graph), asserts that
    every returned tensor is equal, and returns the eager ones."""
    eager = step(layer)
    torch._dynamo.reset()
    try:
        compiled = step(torch.compile(layer, backend="aot_eager", fullgraph=True))
    finally:
        torch._dynamo.reset()
    assert len(compiled) == len(eager)
    for got, expected in zip(compiled, eager):
        assert torch.equal(got, expected)
    return eager


@needs_ext
@pytest.mark.parametrize("output_tile", [2, 4], ids=["F(2x2)", "F(4x4)"])
def test_compiled_layers_train_beside_eager_ones(output_tile: int) -> None:
    """``model.compile=backbone`` beside Winograd heads that stay eager: the compiled graph's layer and an eager layer
    both run between the forward and the backward (as the FPN and the RPN head do). Traced, the layer takes buffers
    of the graph's own rather than the kept buffers, which the eager layer rewrites in place: a compiled backward
    that had saved those would fail autograd's version check (it did, in the fp32 ``compile`` bench row). Values
    and gradients equal two eager layers'."""
    first = nn.Conv2d(64, 64, 3, padding=1).to(memory_format=torch.channels_last)
    second = nn.Conv2d(64, 64, 3, padding=1).to(memory_format=torch.channels_last)
    for conv in (first, second):
        conv.__class__ = WinogradConv2d
        conv.output_tile = output_tile
    x = _randn(2, 64, 72, 72, seed=8).contiguous(memory_format=torch.channels_last)  # 2 or 3 chunks of tiles
    assert first.computes_with_winograd(x) and first.tile_side(x) == output_tile

    def step(head: nn.Module) -> list[torch.Tensor]:
        image = x.clone().requires_grad_()
        out = second(head(image).relu())
        return [out.detach(), *torch.autograd.grad(out.square().sum(), [image, *first.parameters(),
                                                                        *second.parameters()])]

    _same_eager_and_compiled(step, first)


# ------------------------------------------------------------------------------------------- F(4x4, 3x3)
# model.winograd_output_tile=4: 6x6 input tiles at stride 4, 36 products per 4x4 output tile.

#: Largest factor a tile transform multiplies an input by, per output tile side: the sum of a row's absolute
#: entries, squared (F(4x4): B^T's 4 + 5 + 1 = 10 on the input side, A^T's 1 + 1 + 8 + 8 + 1 = 19 on the output).
_GAIN = {"winograd_input_tiles_": 100, "winograd_gradient_tiles_": 1, "output": 361}


def _f4_reference_tiles(name: str, x: torch.Tensor) -> torch.Tensor:
    n, c, h, w = x.shape
    tiles = torch.empty(36, tile_count(n, h, w, 4), c, dtype=x.dtype)
    getattr(reference, name)(tiles, x)
    return tiles


def _f4_close(actual: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor, gain: float) -> None:
    """As :func:`_close_to_rounding`, for sums of 36 terms scaled by up to ``gain``."""
    acc = torch.float64 if actual.dtype == torch.float64 else torch.float32
    atol = 36 * gain * torch.finfo(acc).eps * inputs.double().abs().max().item() + 1e-30
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=torch.finfo(actual.dtype).eps)


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", MAPS + [(2, 70, 13, 8)], ids=str)
def test_f4_tile_ops_match_the_reference(dtype: torch.dtype, shape: tuple[int, int, int, int]) -> None:
    """[36, T, C] tiles select F(4x4, 3x3) in the kernels: T = N * ceil(H/4) * ceil(W/4); channel counts above and
    not a multiple of its 64-wide chunk."""
    x = _randn(*shape, dtype=dtype)
    n, c, h, w = shape
    for op, ref in ((winograd_input_tiles, "winograd_input_tiles_"),
                    (winograd_gradient_tiles, "winograd_gradient_tiles_")):
        for layout in (torch.contiguous_format, NHWC):
            out = op(x.contiguous(memory_format=layout), output_tile=4)
            assert out.shape == (36, n * -(-h // 4) * -(-w // 4), c) and out.dtype == dtype
            _f4_close(out, _f4_reference_tiles(ref, x), x, _GAIN[ref])


@needs_ext
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", MAPS, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_f4_output_op_matches_the_reference(dtype: torch.dtype, shape: tuple[int, int, int, int], bias: bool) -> None:
    n, c, h, w = shape
    products = _randn(36, tile_count(n, h, w, 4), c, dtype=dtype)
    b = _randn(c, dtype=dtype, seed=1) if bias else None
    out = winograd_output(products, n, h, w, b)
    assert out.shape == shape and out.dtype == dtype and out.is_contiguous(memory_format=NHWC)
    _f4_close(out, _reference_output(products, n, h, w, b), products, _GAIN["output"])


@needs_ext
@pytest.mark.parametrize("shape", [(0, 4, 6, 6), (2, 0, 6, 6), (2, 4, 0, 6)], ids=str)
def test_f4_empty_maps(shape: tuple[int, int, int, int]) -> None:
    x = torch.zeros(shape)
    n, c, h, w = shape
    tiles = winograd_input_tiles(x, output_tile=4)
    assert tiles.shape == (36, tile_count(n, h, w, 4), c)
    assert winograd_gradient_tiles(x, output_tile=4).shape == tiles.shape
    assert winograd_output(tiles, n, h, w).shape == shape


@pytest.mark.parametrize("compiled", [True, False], ids=["kernel", "reference"])
def test_f4_tile_ranges_are_slices_of_the_whole(compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_kernels(compiled, monkeypatch)
    n, c, h, w = 2, 6, 9, 7
    x = _randn(n, c, h, w, dtype=torch.float64)
    tiles = tile_count(n, h, w, 4)
    assert tiles == 2 * 3 * 2
    for op in (winograd_input_tiles, winograd_gradient_tiles):
        whole = op(x, output_tile=4)
        for begin, end in ((0, 5), (5, 9), (9, tiles), (7, 7)):
            torch.testing.assert_close(op(x, begin, end, output_tile=4), whole[:, begin:end], atol=0, rtol=0)
    products = _randn(36, tiles, c, dtype=torch.float64, seed=1)
    whole = winograd_output(products, n, h, w)
    out = torch.full_like(whole, float("nan"))
    winograd_output_(out, products[:, 5:9], None, 5)
    written = ~out.isnan()
    assert written.any() and not written.all()
    torch.testing.assert_close(out[written], whole[written], atol=0, rtol=0)


@pytest.mark.parametrize("compiled", [True, False], ids=["weight-kernels", "weight-reference"])
def test_f4_reference_transforms_compose_to_a_convolution_in_float64(compiled: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """F(4x4, 3x3) forward and input gradient, and the weight gradient as F(3x3, 4x4) on the same input tiles, give
    ``F.conv2d``'s to float64 rounding (partial last tiles both ways), by the weight transforms' kernels and their
    reference."""
    _use_kernels(compiled, monkeypatch)
    x, weight = _randn(2, 3, 9, 6, dtype=torch.float64), _randn(4, 3, 3, 3, dtype=torch.float64, seed=1)
    grad = _randn(2, 4, 9, 6, dtype=torch.float64, seed=2)
    tiles = _f4_reference_tiles("winograd_input_tiles_", x)
    out = _reference_output(torch.bmm(tiles, winograd_weight_tiles(weight, output_tile=4)), 2, 9, 6, None)
    torch.testing.assert_close(out, F.conv2d(x, weight, padding=1), atol=1e-12, rtol=1e-12)
    grad_x = _reference_output(torch.bmm(_f4_reference_tiles("winograd_input_tiles_", grad),
                                         winograd_weight_tiles(weight, transposed=True, output_tile=4)), 2, 9, 6, None)
    leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
    expected = torch.autograd.grad(F.conv2d(*leaves, padding=1), leaves, grad)
    torch.testing.assert_close(grad_x, expected[0], atol=1e-12, rtol=1e-12)
    products = torch.bmm(_f4_reference_tiles("winograd_gradient_tiles_", grad).transpose(1, 2), tiles)
    torch.testing.assert_close(winograd_weight_gradient(products, weight), expected[1], atol=1e-12, rtol=1e-12)


def test_f4_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"output_tile must be one of \(2, 4\).*got 3"):
        winograd_input_tiles(torch.zeros(1, 2, 4, 4), output_tile=3)
    with pytest.raises(ValueError, match=r"winograd_output: products must be \[36, 4, C\] for a \[1, C, 5, 5\] map"):
        winograd_output(torch.zeros(36, 3, 2), 1, 5, 5)
    with pytest.raises(ValueError, match=r"Winograd tiles must be \[16, T, C\] \(F\(2x2, 3x3\)\) or \[36, T, C\]"):
        winograd_weight_gradient(torch.zeros(25, 2, 2), torch.zeros(2, 2, 3, 3))
    with pytest.raises(ValueError, match=r"out must be a contiguous \[36, 3, 4\]"):
        winograd_weight_tiles(torch.zeros(4, 3, 3, 3), out=torch.zeros(16, 4, 3), output_tile=4)
    for bad in (3, True, "4"):
        with pytest.raises(ValueError, match=r"model.winograd_output_tile must be 2 \(F\(2x2, 3x3\)\) or 4"):
            winograd_conv3x3(torch.zeros(1, 2, 4, 4), torch.zeros(2, 2, 3, 3), None, bad)


@pytest.mark.parametrize("size", [(14, 14), (5, 7), (1, 1), (8, 12)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_f4_conv_matches_conv2d(size: tuple[int, int], dtype: torch.dtype) -> None:
    x, w, b = _conv_inputs(3, 6, 5, size, dtype)
    out = winograd_conv3x3(x, w, b, output_tile=4)
    assert out.dtype == dtype and out.is_contiguous(memory_format=NHWC)
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(out, F.conv2d(x, w, b, padding=1), atol=tol, rtol=tol)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("size", [(4, 6), (7, 5)], ids=str)
def test_f4_gradcheck_float64(bias: bool, size: tuple[int, int]) -> None:
    x, w, b = _conv_inputs(2, 3, 4, size, torch.float64)
    args = [x.requires_grad_(), w.requires_grad_(), b.requires_grad_() if bias else None, 4]
    assert torch.autograd.gradcheck(winograd_conv3x3, args)


def test_f4_overlapping_last_chunk_equals_conv2d(monkeypatch: pytest.MonkeyPatch) -> None:
    """F(4x4) chunks hold 16/36 of F(2x2)'s tile count, rounded down to the granule: 448 by default. With 16 -> 6
    tiles per chunk and a granule of 3, 5 images of 5x5 (20 tiles) run in 4 chunks, the last starting 1 tile inside
    the one before; output and all gradients equal F.conv2d's in float64."""
    from lit_amp_det.models import winograd_conv

    assert winograd_conv.chunk_tiles(4) == 448 and winograd_conv.chunk_tiles(2) == winograd_conv.CHUNK_TILES
    monkeypatch.setattr(winograd_conv, "CHUNK_TILES", 16)
    monkeypatch.setattr(winograd_conv, "TILE_GRANULE", 3)
    assert winograd_conv.chunk_tiles(4) == 6
    assert winograd_conv._chunks(tile_count(5, 5, 5, 4), 4) == [(0, 6, 0), (6, 12, 0), (12, 18, 0), (17, 20, 1)]
    _assert_equals_conv2d_in_float64(5, (5, 5), output_tile=4)


@needs_ext
def test_f4_float32_error_at_a_real_size() -> None:
    """The R50-FPN mask head's 256-channel layer on 20 RoIs (320 4x4 tiles of 14x14 maps), forward and every
    gradient, in float32, against a float64 convolution. Measured (largest error / largest value): F(4x4) 6-10e-6,
    F(2x2) 1.5-5.4e-7, oneDNN's direct convolution 1.8-2.7e-6; bounded here at 2e-5 and at 8x oneDNN's. (bf16
    autocast's rounding is 4e-3.)"""
    g = torch.Generator().manual_seed(3)
    plain = nn.Conv2d(256, 256, 3, padding=1)
    x = torch.randn(20, 256, 14, 14, generator=g).contiguous(memory_format=NHWC)
    grad = torch.randn(20, 256, 14, 14, generator=g)

    def run(conv, inputs: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:  # noqa: ANN001
        leaves = [t.detach().to(dtype).requires_grad_() for t in (inputs, plain.weight, plain.bias)]
        out = conv(*leaves)
        out.backward(grad.to(dtype))
        return [out.detach(), *[leaf.grad for leaf in leaves]]

    def direct(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, w, b, padding=1)

    exact = run(direct, x, torch.float64)
    onednn = run(direct, x, torch.float32)
    ours = run(lambda *a: winograd_conv3x3(*a, output_tile=4), x, torch.float32)
    for name, a, b, e in zip(("output", "input grad", "weight grad", "bias grad"), ours, onednn, exact, strict=True):
        scale = e.abs().max().item()
        ours_error = (a.double() - e).abs().max().item() / scale
        onednn_error = (b.double() - e).abs().max().item() / scale
        assert ours_error < 2e-5, name
        assert ours_error < 8 * onednn_error + 1e-7, name


@needs_ext
def test_f4_is_taken_only_where_the_layer_computes_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """``output_tile=4`` layers run F(4x4) in float32 and keep F(2x2) in bf16 (and under bf16 autocast)."""
    from lit_amp_det.models import winograd_conv

    for rule in ("MIN_TILES", "FP32_MIN_TILES", "FP32_MIN_CHANNEL_TILES"):  # a small map takes tiles in every dtype
        monkeypatch.setattr(winograd_conv, rule, 1)
    calls: list[int] = []
    original = winograd_conv.winograd_conv3x3
    monkeypatch.setattr(winograd_conv, "winograd_conv3x3", lambda *a: calls.append(a[3]) or original(*a))
    layer = nn.Conv2d(256, 256, 3, padding=1)
    assert use_winograd_convs(nn.ModuleDict({"roi_heads": nn.ModuleDict({"mask_head": layer})}), ["mask_head"], 4) == 1
    assert isinstance(layer, WinogradConv2d) and layer.output_tile == 4
    x = torch.randn(1, 256, 32, 32).contiguous(memory_format=NHWC)  # 256 2x2 tiles: F4_MIN_TILES
    layer(x)
    layer.bfloat16()(x.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer.float()(x)
    assert calls == [4, 2, 2]
    with pytest.raises(ValueError, match="model.winograd_output_tile must be 2"):
        use_winograd_convs(nn.Module(), ["mask_head"], 3)


@needs_ext
def test_f4_is_taken_from_f4_min_tiles() -> None:
    """fp32 ``output_tile=4`` layers take F(4x4) from F4_MIN_TILES 2x2 tiles and F(2x2) below it (where F(4x4)'s
    larger weight tiles outweigh its fewer products); ``output_tile=2`` layers never take F(4x4)."""
    from lit_amp_det.models.winograd_conv import F4_MIN_TILES

    assert F4_MIN_TILES == 256
    layer = _switched_layer(64)
    layer.output_tile = 4
    for shape, side in (((1, 64, 32, 32), 4), ((1, 64, 30, 32), 2), ((4, 64, 14, 14), 2), ((4, 64, 28, 28), 4)):
        x = torch.zeros(shape).contiguous(memory_format=NHWC)
        assert layer.tile_side(x) == side, shape
    layer.output_tile = 2
    assert layer.tile_side(torch.zeros(4, 64, 28, 28)) == 2


def test_f4_config_default_and_bad_value() -> None:
    assert compose_config([]).model.winograd_output_tile == 2
    with pytest.raises(Exception, match=r"model.winograd_output_tile must be 2 \(F\(2x2, 3x3\)\) or 4.*got 8"):
        _tiny_module("model.winograd_output_tile=8")


@needs_ext
def test_f4_opcheck() -> None:
    """torch.library.opcheck with [36, T, C] tiles: the same schemas and fake kernels serve F(4x4, 3x3)."""
    x = _randn(2, 3, 9, 7)  # 3 x 2 4x4 tiles per image
    torch.library.opcheck(torch.ops.lit_amp_det.winograd_input_tiles_.default, (torch.empty(36, 7, 3), x, 5))
    torch.library.opcheck(torch.ops.lit_amp_det.winograd_gradient_tiles_.default, (torch.empty(36, 12, 3), x, 0))
    out = torch.zeros(2, 3, 9, 7).contiguous(memory_format=NHWC)
    torch.library.opcheck(torch.ops.lit_amp_det.winograd_output_.default, (out, _randn(36, 6, 3), _randn(3), 4))

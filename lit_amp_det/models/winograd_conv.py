"""3x3 convolutions computed with Winograd's F(2x2, 3x3) algorithm (2.25x fewer multiplications), or F(4x4, 3x3) in
float32 (4x fewer).

A 3x3 convolution with stride 1 and padding 1 computes each 2x2 output tile from a 4x4 input tile with 16
elementwise products instead of 36 multiplications (Lavin & Gray, 2016; cuDNN and oneDNN have such algorithms, but
oneDNN's CPU Winograd is fp32-only). Summed over input channels, the 16 products are 16 matrix products
``[T, C_in] @ [C_in, C_out]`` over the T tiles of the batch, so the work becomes ``torch.bmm`` plus three
memory-bound tile transforms (:mod:`lit_amp_det.ops.winograd`). The backward is two more such convolutions: the
input gradient is the same algorithm with the filters rotated and transposed, the weight gradient F(3x3, 2x2) with
the output-gradient tile as the filter.

Why: the mask head's four 256 -> 256 convolutions on ``[K, 256, 14, 14]`` RoI maps are the largest single cost of an
R50-FPN training step on the CPU (measured on the dev CPU, 2-core AMD EPYC, bf16 channels_last, 70 RoIs: 49 ms
forward + backward per layer with oneDNN, already at its bf16 peak). Figures: BENCHMARKS.md.

In float32 on a CPU without AVX-512 it pays more: oneDNN's direct fp32 convolution there runs at 83-118 GFLOP/s
(forward + backward), and the Winograd form was 1.8x faster on that mask-head layer and 2.4x on the R50-FPN's
256-channel FPN and RPN convolutions of a 256 px batch (AVX2 AMD EPYC, 2 cores; BENCHMARKS.md, "Winograd in fp32").

F(4x4, 3x3) (``model.winograd_output_tile=4``, float32 layers only) computes 4x4 output tiles from 6x6 input tiles
with 36 products: 4x fewer multiplications than the direct convolution, 1.78x fewer than F(2x2, 3x3) on maps a
multiple of 4 wide, and 2.25 instead of 4 tile values per output pixel for the transforms to move. Measured on the
AVX2 CPU, forward + backward against F(2x2, 3x3): 1.5x on the R50-FPN's P2 and the light FPN's P2, 1.4x on
ResNet-18's layer1-2, 1.2x on the mask head's 14x14 maps (16x16 covered: 1.36x fewer multiplications), 1.0x on
ResNet-18's layer3 (14x14 at batch 4: 64 tiles). Its rounding error is about 20x F(2x2, 3x3)'s and 4x oneDNN's
(BENCHMARKS.md, "Winograd F(4x4, 3x3)").

Numerics: exact in real arithmetic (float64 agrees with ``F.conv2d`` to 1e-13), but in bf16 the transformed tiles
and the 16 products are rounded to bf16 before the output transform sums them: measured relative error 0.5 % against
a float64 convolution of the same bf16 operands, 3x that of oneDNN's bf16 convolution (0.17 %), both near bf16's
unit roundoff (0.39 %). In float32 the error is below oneDNN's own (4e-7 against 1-2e-6 of the largest output,
measured at the sizes above). It is a switch (``model.winograd_convs``), taken where a layer computes in fp16, bf16
or fp32 on the CPU with the compiled extension and is large enough for its dtype (:func:`winograd_pays`); float64,
CUDA and every other geometry run ``F.conv2d``. Double backward is not supported (the backward's kernels are not
differentiable).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lit_amp_det import cpu_model
from lit_amp_det.models.bounded_matmul import Chunk, row_chunks
from lit_amp_det.models.half_compute import HALF_DTYPES, apply_with_autocast_casts, convolution_dtype
from lit_amp_det.ops._extension import extension_available
from lit_amp_det.ops.winograd import (
    OUTPUT_TILES,
    POSITIONS,
    accumulation_dtype,
    tile_count,
    winograd_gradient_tiles_,
    winograd_input_tiles_,
    winograd_output_,
    winograd_weight_gradient,
    winograd_weight_tiles,
)

__all__ = [
    "CHUNK_TILES",
    "F4_MIN_TILES",
    "FP32_MIN_CHANNELS",
    "FP32_MIN_CHANNEL_TILES",
    "FP32_MIN_TILES",
    "MIN_CHANNELS",
    "MIN_TILES",
    "SPLIT_VECTOR_MIN_TILES",
    "TILE_GRANULE",
    "WINOGRAD_PARTS",
    "WeightTileCache",
    "WinogradConv2d",
    "check_output_tile",
    "chunk_tiles",
    "direct_convolutions",
    "half_min_tiles",
    "is_winograd_shape",
    "release_workspace",
    "use_winograd_convs",
    "winograd_conv3x3",
    "winograd_pays",
]

#: Where ``model.winograd_convs`` may switch the 3x3 convolutions: the detector's submodules.
WINOGRAD_PARTS = {
    "mask_head": ("roi_heads", "mask_head"),
    "rpn_head": ("rpn", "head"),
    "fpn": ("backbone", "fpn"),
    "backbone": ("backbone", "body"),
}


#: fp16/bf16: below these sizes oneDNN's direct convolution was as fast or faster (dev CPU with AVX-512 BF16 on its
#: Zen 5 host, bf16, forward + backward): 256 -> 256 channels on 2x32x32 maps (512 tiles) 8.8 vs 9.5 ms, 20 RoIs of
#: 14x14 (980 tiles) 14.3 vs 14.3 ms, 40 RoIs (1960 tiles) 28.6 vs 25.6 ms; 128 channels on 4x64x64 maps (4096 tiles)
#: 15.4 vs 15.8 ms.
MIN_TILES = 1024
MIN_CHANNELS = 256
#: fp16/bf16 tiles from this many on a CPU that runs 512-bit instructions as two halves (AMD Zen 4:
#: :func:`lit_amp_det.cpu_model.splits_512_bit_vectors`), where the direct convolution's multiplications take twice
#: a full-width core's time and the memory-bound tile transforms the same. ``bench ops --only winograd_sizes
#: --repeats 5`` on the dev VM's Zen 4 host (bf16, forward + backward, C -> C channels, T 2x2 tiles; speed-up of the
#: tiles): C=256: T=64 0.78-0.79x, T=128 1.01x, T=196 1.12x, T=256 1.16x, T=784 1.32x, T=4096 1.34x; C=512: T=64
#: 0.80-0.81x, T=128 1.10x, T=196 1.21x, T=784 1.55x; C=128 at most 0.99x, C <= 64 at most 0.77x. So
#: :data:`MIN_CHANNELS` and 128 tiles there.
SPLIT_VECTOR_MIN_TILES = 128
#: fp32: the smallest layers the Winograd form beats oneDNN's direct fp32 convolution on, forward + backward,
#: channels_last, C -> C channels (AVX2 AMD EPYC, 2 cores; two in-process sweeps with the weight transforms as
#: kernels, 9 alternated calls each, medians; speed-up of F(2x2) tiles at C channels and T 2x2 tiles): C=32 0.56-0.90x
#: everywhere; C=64: T=64 0.72-0.88x, T=128 1.00-1.04x, T=196 0.85-1.03x, T=256 1.14-1.23x, T=784 1.17-1.27x;
#: C=128: T=64 0.89-1.14x, T=128 1.17-1.21x, T=196 1.18-1.25x; C=256: T=64 1.09-1.89x, T=128 1.53-1.59x; C=512: T=64
#: 1.38-2.00x, T=128 1.97-2.16x. (Before the weight transforms were kernels, C=256 and C=512 at T=64 read 0.86-1.45x:
#: their transforms weigh most where there are few tiles.) So: >= 64 channels, >= 64 tiles, channels x tiles >= 16384.
FP32_MIN_CHANNELS = 64
FP32_MIN_TILES = 64
FP32_MIN_CHANNEL_TILES = 16384
#: fp32 layers of ``output_tile=4`` take F(4x4, 3x3) tiles from this many 2x2 tiles, F(2x2, 3x3) below: F(4x4) has
#: fewer, larger products and 2.25x the weight tiles, which pays only on enough tiles (the sweeps above, F(4x4) vs
#: F(2x2): T=256 1.12-1.40x at every channel count; T=196 0.91-1.15x, T=128 0.89-1.14x, T=64 0.77-1.10x, the larger
#: channel counts losing most: ResNet-18's layer3 at 224 px, batch 4, is T=196, its layer4 T=64).
F4_MIN_TILES = 256
#: Tiles per chunk: a chunk's input tiles and products (8 MB each for 1024 tiles of 256 channels in bf16) are made,
#: multiplied and consumed before the next, in buffers kept from call to call (:class:`_Workspace`), so memory stays
#: small at any image size (the R50-FPN level P2 at 800x1333 has 16 800 tiles per image). Profiled on the dev CPU
#: (R50 mask-head layer, bf16, forward + backward): 2048 tiles 86-92 ms, 1024 92-94, 512 95-96 (each chunk costs a
#: little Python and an fp32 sum of the weight gradient); kept memory 40, 24 and 16 MB.
CHUNK_TILES = 1024
#: The last chunk's size is rounded up to a multiple of this (by overlapping the chunk before it), so a layer's
#: matrix products take at most ``CHUNK_TILES / TILE_GRANULE`` shapes whatever its tile count: oneDNN keeps each bf16
#: matmul shape it has seen (about 0.5 MB each, up to ~540 MB: :mod:`lit_amp_det.models.bounded_matmul`), and the
#: tile count of the mask head changes with the RoI count of every training step.
TILE_GRANULE = 64


def chunk_tiles(output_tile: int = 2) -> int:
    """Tiles per chunk: :data:`CHUNK_TILES` for F(2x2, 3x3); for F(4x4, 3x3), whose tiles have 36 positions instead
    of 16, as many as hold about the same number of rows (448 by default), a multiple of :data:`TILE_GRANULE`."""
    if output_tile == 2:
        return CHUNK_TILES
    rows = CHUNK_TILES * POSITIONS[2] // POSITIONS[output_tile]
    return max(TILE_GRANULE, rows // TILE_GRANULE * TILE_GRANULE)


_DIRECT = contextvars.ContextVar("lit_amp_det_direct_convolutions", default=False)


@contextlib.contextmanager
def direct_convolutions() -> Iterator[None]:
    """Within it every :class:`WinogradConv2d` runs the direct convolution: what the bench uses to count the model's
    FLOPs (the work the model defines, as a direct convolution does it) beside the FLOPs a Winograd step executes."""
    token = _DIRECT.set(True)
    try:
        yield
    finally:
        _DIRECT.reset(token)


def is_winograd_shape(conv: nn.Conv2d) -> bool:
    """True for a 3x3 ``Conv2d`` with stride 1, padding 1 (zeros), dilation 1 and one group: the layers F(2x2, 3x3)
    computes."""
    return (tuple(conv.kernel_size) == (3, 3) and tuple(conv.stride) == (1, 1) and conv.padding in ((1, 1), "same")
            and tuple(conv.dilation) == (1, 1) and conv.groups == 1 and conv.padding_mode == "zeros")


def winograd_pays(dtype: torch.dtype, channels: int, tiles: int) -> bool:
    """Whether a layer computing in ``dtype`` with ``channels`` (the smaller of in and out) and ``tiles`` 2x2 output
    tiles is large enough for the Winograd form to beat the direct convolution on this CPU (fp16/bf16:
    :data:`MIN_CHANNELS` and :func:`half_min_tiles`; float32: the ``FP32_`` sizes; never for float64)."""
    if dtype in HALF_DTYPES:
        return channels >= MIN_CHANNELS and tiles >= half_min_tiles()
    if dtype == torch.float32:
        return (channels >= FP32_MIN_CHANNELS and tiles >= FP32_MIN_TILES
                and channels * tiles >= FP32_MIN_CHANNEL_TILES)
    return False


@torch.compiler.assume_constant_result  # torch.compile takes its value (it reads /proc/cpuinfo, which Dynamo cannot)
def half_min_tiles() -> int:
    """The fewest 2x2 tiles an fp16/bf16 layer takes the Winograd form from on this CPU: :data:`MIN_TILES`, or
    :data:`SPLIT_VECTOR_MIN_TILES` where the CPU splits its 512-bit instructions (AMD Zen 4)."""
    return SPLIT_VECTOR_MIN_TILES if cpu_model.splits_512_bit_vectors() else MIN_TILES


def _chunks(tiles: int, output_tile: int = 2) -> list[Chunk]:
    """:func:`chunk_tiles` tiles at a time, the last chunk a multiple of :data:`TILE_GRANULE` tiles that overlaps the
    one before (:func:`~lit_amp_det.models.bounded_matmul.row_chunks`): the overlapping tiles' outputs are written
    twice, with the same values (oneDNN computes a row alike in any row count, bit for bit on the dev CPU), and the
    weight gradient zeroes their gradient tiles so that they are summed once."""
    return row_chunks(tiles, chunk_tiles(output_tile), TILE_GRANULE)


class _Workspace(threading.local):
    """The convolution's temporaries, kept from call to call (one set per thread, dtype and device): a chunk's tiles
    and products, the weight's tiles and the weight gradient's products and their fp32 sum are written into the same
    memory every time, so the convolution allocates only its result and the CPU heap does not fragment (fresh 10-16
    MB temporaries per chunk raised a training step's resident peak by 50-120 MB).

    A buffer made under ``torch.inference_mode`` is made again for the first call outside it (its successor, a
    normal tensor, serves both).

    Not while ``torch.compile`` traces the layer: a traced graph would take the kept buffers as inputs and save them
    for its backward, and any eager Winograd layer that ran in between (the RPN head after a compiled FPN) rewrites
    them in place, so the compiled backward failed autograd's version check. Traced, each call gets buffers of its
    own, which the compiler plans and reuses itself."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device], Tensor] = {}

    def get(self, slot: str, rows: int, columns: int, like: Tensor, dtype: torch.dtype | None = None,
            positions: int = 16) -> Tensor:
        """A contiguous ``[positions, rows, columns]`` view of buffer ``slot`` in ``dtype`` (``like``'s by default)
        on ``like``'s device, grown when too small."""
        dtype = like.dtype if dtype is None else dtype
        if torch.compiler.is_compiling():
            return torch.empty((positions, rows, columns), dtype=dtype, device=like.device)
        size = positions * rows * columns
        key = (slot, dtype, like.device)
        buffer = self.buffers.get(key)
        # a buffer made under torch.inference_mode (Lightning's validation, predict) is an inference tensor, which
        # may not be written outside it: training after a validation would fail in its first Winograd layer
        if (buffer is None or buffer.numel() < size
                or (buffer.is_inference() and not torch.is_inference_mode_enabled())):
            self.buffers.pop(key, None)  # free the old one first
            buffer = self.buffers[key] = torch.empty(size, dtype=dtype, device=like.device)
        return buffer[:size].view(positions, rows, columns)


_WORKSPACE = _Workspace()


def release_workspace() -> None:
    """Frees this thread's buffers (for 256 channels in bf16: 8 MB for a chunk's tiles, 8 MB for its products, 2 MB
    for the weight's tiles, 2 MB for the weight gradient's products and 4 MB for their fp32 sum)."""
    _WORKSPACE.buffers.clear()


def _convolve(x: Tensor, weight: Tensor, bias: Tensor | None, transposed: bool = False,
              output_tile: int = 2, weight_tiles: Tensor | None = None) -> Tensor:
    """The convolution of NHWC ``x`` with ``weight`` (``transposed``: with its rotated, transposed filters, the
    input gradient's convolution), chunk by chunk of ``output_tile``-sided tiles; ``weight_tiles``: the weight's
    tiles made earlier (:class:`WeightTileCache`), else they are made here. The output is allocated before any
    temporary, so that the temporaries are freed from the top of the CPU heap and leave no holes below the
    long-lived tensors."""
    n, c_in, height, width = x.shape
    c_out = weight.shape[1] if transposed else weight.shape[0]
    positions = POSITIONS[output_tile]
    out = torch.empty((n, c_out, height, width), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    tiles_of_weight = weight_tiles
    if tiles_of_weight is None:
        filters = _WORKSPACE.get("filters", c_in, c_out, weight, positions=positions)  # [positions, C_in, C_out]
        tiles_of_weight = winograd_weight_tiles(weight, transposed=transposed, out=filters, output_tile=output_tile)
    for begin, end, _ in _chunks(tile_count(n, height, width, output_tile), output_tile):
        tiles = winograd_input_tiles_(_WORKSPACE.get("tiles", end - begin, c_in, x, positions=positions), x, begin)
        products = torch.bmm(tiles, tiles_of_weight,
                             out=_WORKSPACE.get("products", end - begin, c_out, x, positions=positions))
        winograd_output_(out, products, bias, begin)
    return out


def _weight_gradient(x: Tensor, grad: Tensor, weight: Tensor, output_tile: int = 2) -> Tensor:
    """F(3x3, m x m): the 16 (36) products ``[C_out, T] @ [T, C_in]`` of gradient and input tiles, summed over the
    chunks in fp32 (fp64 for fp64), then ``A'^T s A'`` (into a gradient allocated first, as in :func:`_convolve`)."""
    n, c_in, height, width = x.shape
    c_out = grad.shape[1]
    positions = POSITIONS[output_tile]
    out = torch.empty_like(weight)
    acc = accumulation_dtype(x.dtype)
    total = _WORKSPACE.get("weight_sum", c_out, c_in, x, acc, positions=positions)
    for k, (begin, end, overlap) in enumerate(_chunks(tile_count(n, height, width, output_tile), output_tile)):
        grad_tiles = winograd_gradient_tiles_(
            _WORKSPACE.get("products", end - begin, c_out, grad, positions=positions), grad, begin)
        grad_tiles[:, :overlap].zero_()  # tiles the chunk before has summed already
        tiles = winograd_input_tiles_(_WORKSPACE.get("tiles", end - begin, c_in, x, positions=positions), x, begin)
        if x.dtype == acc:  # straight into the sum (beta 0: the buffer's earlier contents are ignored)
            total.baddbmm_(grad_tiles.transpose(1, 2), tiles, beta=1 if k else 0)
            continue
        products = torch.bmm(grad_tiles.transpose(1, 2), tiles,
                             out=_WORKSPACE.get("weight", c_out, c_in, x, positions=positions))
        total.add_(products) if k else total.copy_(products)
    return winograd_weight_gradient(total, weight, out=out)


class _WinogradConv3x3(torch.autograd.Function):
    """``F.conv2d(x, weight, bias, padding=1)`` for a 3x3 ``weight``, by F(2x2, 3x3) or F(4x4, 3x3) tiles (every
    pass: forward, input and weight gradients); channels_last output."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, output_tile: int) -> Tensor:
        x = x.contiguous(memory_format=torch.channels_last)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.output_tile = output_tile
        return _convolve(x, weight, bias, output_tile=output_tile)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        if torch.is_grad_enabled():  # create_graph=True: the kernels below have no derivatives of their own
            raise RuntimeError("winograd_conv3x3 is differentiable once: its backward cannot build a graph "
                               "(create_graph=True). Set model.winograd_convs=[] for double backward.")
        x, weight = ctx.saved_tensors
        grad = grad.contiguous(memory_format=torch.channels_last)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:  # the convolution of the gradient with the rotated, transposed filters
            grad_x = _convolve(grad, weight, None, transposed=True, output_tile=ctx.output_tile)
        if ctx.needs_input_grad[1]:
            grad_weight = _weight_gradient(x, grad, weight, output_tile=ctx.output_tile)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum((0, 2, 3))
        return grad_x, grad_weight, grad_bias, None


def winograd_conv3x3(x: Tensor, weight: Tensor, bias: Tensor | None = None, output_tile: int = 2) -> Tensor:
    """``F.conv2d(x, weight, bias, padding=1)`` for ``x`` ``[N, C_in, H, W]`` and a 3x3 ``weight``
    ``[C_out, C_in, 3, 3]`` by Winograd F(2x2, 3x3) tiles (``output_tile=4``: F(4x4, 3x3), for float32),
    differentiable once; returns a channels_last tensor. Under autocast the operands are cast to the autocast dtype
    first, as ``F.conv2d`` casts them."""
    if x.dim() != 4 or weight.dim() != 4 or tuple(weight.shape[2:]) != (3, 3) or weight.shape[1] != x.shape[1]:
        raise ValueError(f"winograd_conv3x3 needs x [N, C_in, H, W] and weight [C_out, C_in, 3, 3], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    check_output_tile(output_tile)
    return apply_with_autocast_casts(_WinogradConv3x3, x, weight, bias, output_tile)


def check_output_tile(output_tile: int) -> None:
    """Raises a ValueError naming ``model.winograd_output_tile`` unless ``output_tile`` is 2 or 4."""
    if isinstance(output_tile, bool) or output_tile not in OUTPUT_TILES:
        raise ValueError(f"model.winograd_output_tile must be 2 (F(2x2, 3x3)) or 4 (F(4x4, 3x3), float32 only), got "
                         f"{output_tile!r}")


class WeightTileCache:
    """One layer's forward weight tiles (``[positions, C_in, C_out]``), kept from call to call while its weight is
    unchanged: inference and validation reuse them, instead of transforming every filter again in each call (7 % of
    a light-model inference call at batch 4, and on 512-channel maps with few tiles up to 37 % of the layer's own
    time; BENCHMARKS.md).

    The tiles are reused only for the layer's own weight parameter, with no autograd graph to build, computing in
    the weight's own dtype (no autocast cast, which makes a new weight each call), and while that weight is the same
    memory (same address, strides and dtype) at the same version (in-place updates, as an optimizer step or
    ``load_state_dict`` makes, count up the version). The cache holds an alias of the weight it was made from, so
    that no other tensor can take that address while the entry lives. A call that builds a graph (training) drops
    the entry: the memory is held only between weight updates. A weight folded with its BatchNorm on the fly
    (ConvBNEval without ``fold_on_predict``) is a new tensor every call, and is not cached.
    """

    def __init__(self) -> None:
        self._entry: tuple[Tensor, int, int, Tensor] | None = None  # (weight alias, version, tile side, tiles)

    def tiles(self, weight: Tensor, output_tile: int) -> Tensor:
        """``weight``'s forward tiles for ``output_tile``-sided tiles: the kept ones when still valid, else new ones
        (kept)."""
        entry = self._entry
        if entry is not None:
            source, version, side, tiles = entry
            if (side == output_tile and source.data_ptr() == weight.data_ptr() and source.device == weight.device
                    and source.dtype == weight.dtype and source.stride() == weight.stride()
                    and source.shape == weight.shape and version == weight._version):
                return tiles
        self._entry = None  # free the old tiles before making the new ones
        c_out, c_in = weight.shape[:2]
        tiles = torch.empty((POSITIONS[output_tile], c_in, c_out), dtype=weight.dtype, device=weight.device)
        winograd_weight_tiles(weight, out=tiles, output_tile=output_tile)
        self._entry = (weight.detach(), weight._version, output_tile, tiles)
        return tiles

    def clear(self) -> None:
        """Drops the kept tiles."""
        self._entry = None

    @property
    def nbytes(self) -> int:
        """Bytes of the kept tiles (0 when none are kept)."""
        return 0 if self._entry is None else self._entry[3].nbytes


class WinogradConv2d(nn.Conv2d):
    """``nn.Conv2d`` that computes a 3x3, stride-1, padding-1 layer (:func:`is_winograd_shape`) in fp16/bf16/fp32 on
    the CPU by Winograd tiles where it is large enough (:func:`winograd_pays`); everything else runs ``nn.Conv2d``'s
    convolution. Same parameters and ``state_dict`` as the layer it replaces.

    ``output_tile`` (class default 2, set per layer by :func:`use_winograd_convs`): 4 computes float32 layers of at
    least :data:`F4_MIN_TILES` 2x2 tiles by F(4x4, 3x3) tiles, 1.78x fewer multiplications than F(2x2, 3x3) on maps
    a multiple of 4 wide (1.36x on the mask head's 14x14) and fewer tile values per output pixel to transform, at a
    larger rounding error (about 4x oneDNN's direct fp32 convolution's: 8e-6 against 2e-6 of the largest output on
    the mask head's layer, 500x below bf16 autocast's rounding). fp16/bf16 layers keep F(2x2, 3x3): their tiles are
    rounded to 8 or 11 bits, which F(4x4, 3x3)'s larger transform entries would amplify.
    """

    output_tile: int = 2
    #: the layer's :class:`WeightTileCache` (set per layer by :func:`use_winograd_convs` with ``cache_weight_tiles``);
    #: None: the tiles are made in every call
    weight_tile_cache: WeightTileCache | None = None

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (torch's name)
        return self.convolve(input, self.weight, self.bias)

    def convolve(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # noqa: A002
        """This layer's convolution of ``input`` with another ``weight`` and ``bias`` of the same shapes (conv-BN
        eval's folded ones), by Winograd tiles when :meth:`computes_with_winograd`."""
        if not self.computes_with_winograd(input):
            return self._conv_forward(input, weight, bias)
        side = self.tile_side(input)
        cache = self.weight_tile_cache
        if cache is not None:
            if torch.is_grad_enabled() or torch.compiler.is_compiling():
                cache.clear()  # training: the weight changes every step
            elif (weight is self.weight and input.dtype == weight.dtype == convolution_dtype(input)
                  and not weight.is_inference()):
                x = input.contiguous(memory_format=torch.channels_last)
                return _convolve(x, weight, bias, output_tile=side, weight_tiles=cache.tiles(weight, side))
        return winograd_conv3x3(input, weight, bias, side)

    def tile_side(self, input: Tensor) -> int:  # noqa: A002 (torch's name)
        """The output tile side the Winograd path takes for ``input``: :attr:`output_tile` where the layer computes
        in float32 on at least :data:`F4_MIN_TILES` 2x2 tiles, 2 otherwise."""
        if self.output_tile == 2 or convolution_dtype(input) != torch.float32:
            return 2
        return self.output_tile if tile_count(input.shape[0], input.shape[2], input.shape[3]) >= F4_MIN_TILES else 2

    def computes_with_winograd(self, input: Tensor) -> bool:  # noqa: A002 (torch's name)
        """True when ``forward(input)`` takes the Winograd path: a batched input on the CPU computed in fp16, bf16 or
        fp32, with the compiled extension loaded, and a layer large enough for that dtype (:func:`winograd_pays`,
        measured for F(2x2, 3x3) and counting 2x2 tiles whatever :attr:`output_tile`; smaller layers run oneDNN's
        convolution, which is faster there)."""
        if _DIRECT.get() or input.dim() != 4 or input.device.type != "cpu" or not is_winograd_shape(self):
            return False
        tiles = tile_count(input.shape[0], input.shape[2], input.shape[3])
        return (winograd_pays(convolution_dtype(input), min(self.in_channels, self.out_channels), tiles)
                and extension_available())


def use_winograd_convs(detector: nn.Module, parts: Sequence[str], output_tile: int = 2,
                       cache_weight_tiles: bool = False) -> int:
    """Switches every 3x3, stride-1 ``nn.Conv2d`` (the exact class: a subclass may have its own ``forward``) in the
    named ``parts`` of the detector (keys of :data:`WINOGRAD_PARTS`) to :class:`WinogradConv2d`, in place, with
    ``output_tile`` (2: F(2x2, 3x3); 4: F(4x4, 3x3) where a layer computes in float32) and, with
    ``cache_weight_tiles``, a :class:`WeightTileCache` each. A part the detector lacks (a Faster R-CNN's mask head)
    is skipped. Returns how many layers were switched."""
    unknown = sorted(set(parts) - set(WINOGRAD_PARTS))
    if unknown:
        raise ValueError(f"model.winograd_convs: unknown part(s) {unknown}; choose from {sorted(WINOGRAD_PARTS)}")
    check_output_tile(output_tile)
    switched = 0
    for part in parts:
        module: nn.Module | None = detector
        for name in WINOGRAD_PARTS[part]:
            module = getattr(module, name, None)
        if module is None:
            continue
        for conv in module.modules():
            if type(conv) is nn.Conv2d and is_winograd_shape(conv) and "forward" not in vars(conv):
                conv.__class__ = WinogradConv2d
                conv.output_tile = output_tile
                conv.weight_tile_cache = WeightTileCache() if cache_weight_tiles else None
                switched += 1
    return switched

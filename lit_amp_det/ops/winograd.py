"""The tile transforms of a Winograd F(2x2, 3x3) or F(4x4, 3x3) convolution, and the small weight transforms around
them.

A 3x3 convolution with stride 1 and padding 1 maps each 4x4 input tile ``d`` (at stride 2) to a 2x2 output tile
``A^T [(G w G^T) * (B^T d B)] A``: the 16 elementwise products of a tile, summed over input channels, are 16 matrix
products ``[T, C_in] @ [C_in, C_out]`` over all T tiles: 2.25x fewer multiplications than the direct convolution
(Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks", 2016). The weight gradient is the same
algorithm with the 2x2 output-gradient tile as the filter (F(3x3, 2x2)), reusing the input tiles ``B^T d B``.
F(4x4, 3x3) does the same with 6x6 input tiles at stride 4 and 4x4 output tiles: 36 products per 16 output pixels,
4x fewer multiplications than the direct convolution (1.78x fewer than F(2x2, 3x3)), at a larger rounding error
(its transforms have entries up to 8 and 1/24), so it is meant for float32. The ``output_tile`` of a tile tensor
follows from its first dimension: 16 positions for 2x2 output tiles, 36 for 4x4 (:data:`POSITIONS`).

* :func:`winograd_input_tiles_` -- ``[N, C, H, W]`` -> ``[16 or 36, T, C]`` input tiles ``B^T d B``, in place
  (:func:`winograd_input_tiles`: into a new tensor).
* :func:`winograd_gradient_tiles_` -- ``[N, C, H, W]`` -> ``[16 or 36, T, C]`` output-gradient tiles
  ``G' g G'^T``.
* :func:`winograd_output_` -- ``[16 or 36, T, C]`` products -> their pixels ``A^T m A`` (+ bias) of a channels_last
  ``[N, C, H, W]`` map, in place (:func:`winograd_output`: into a new map).

Each writes a range of tiles into a given tensor, so that a convolution can run in chunks through buffers it reuses.
* :func:`winograd_weight_tiles` / :func:`winograd_weight_gradient` -- ``G w G^T`` of each 3x3 filter of a weight
  (the products' right-hand operands), and the 3x3 weight gradient ``A'^T s A'`` from the summed gradient products.

All are C++ CPU kernels of ``lit_amp_det._C`` (one memory pass each; maps channels_last, weights in any memory
format); elsewhere (CUDA, where cuDNN picks its own algorithms, or without the extension) their
:mod:`lit_amp_det.ops.reference` implementations. :mod:`lit_amp_det.models.winograd_conv` composes them into a
differentiable convolution.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lit_amp_det.ops import reference
from lit_amp_det.ops._extension import extension_available

__all__ = [
    "OUTPUT_TILES",
    "POSITIONS",
    "accumulation_dtype",
    "output_tile_of",
    "tile_count",
    "winograd_gradient_tiles",
    "winograd_gradient_tiles_",
    "winograd_input_tiles",
    "winograd_input_tiles_",
    "winograd_output",
    "winograd_output_",
    "winograd_weight_gradient",
    "winograd_weight_tiles",
]

#: The output tile sides the transforms compute: F(2x2, 3x3) and F(4x4, 3x3).
OUTPUT_TILES = (2, 4)
#: Transform positions per tile, ``(output_tile + 2) ** 2``, by output tile side.
POSITIONS = {2: 16, 4: 36}

def _compiled_on(tensor: Tensor) -> bool:
    return extension_available() and tensor.device.type == "cpu"


def tile_count(batch_size: int, height: int, width: int, output_tile: int = 2) -> int:
    """The number of ``output_tile`` x ``output_tile`` output tiles of a ``[batch_size, C, height, width]`` map
    (partial ones included)."""
    return batch_size * -(-height // output_tile) * -(-width // output_tile)


def _check_output_tile(output_tile: int, op: str) -> None:
    if output_tile not in OUTPUT_TILES:
        raise ValueError(f"{op}: output_tile must be one of {OUTPUT_TILES} (F(2x2, 3x3) or F(4x4, 3x3)), got "
                         f"{output_tile!r}")


def output_tile_of(tiles: Tensor) -> int:
    """The output tile side of a ``[16 or 36, T, C]`` tile or product tensor: 2 for 16 positions, 4 for 36."""
    for side, positions in POSITIONS.items():
        if tiles.dim() == 3 and tiles.shape[0] == positions:
            return side
    raise ValueError(f"Winograd tiles must be [16, T, C] (F(2x2, 3x3)) or [36, T, C] (F(4x4, 3x3)), got "
                     f"{tuple(tiles.shape)}")


def _check_map(map_: Tensor, op: str, name: str) -> None:
    if map_.dim() != 4 or not map_.is_floating_point():
        raise ValueError(f"{op}: {name} must be a floating [N, C, H, W] tensor, got {map_.dtype} "
                         f"{tuple(map_.shape)}")


def _check_range(map_: Tensor, tile_begin: int, tile_end: int | None, op: str, output_tile: int = 2) -> int:
    tiles = tile_count(map_.shape[0], map_.shape[2], map_.shape[3], output_tile)
    end = tiles if tile_end is None else tile_end
    if not 0 <= tile_begin <= end <= tiles:
        raise ValueError(f"{op}: tiles [{tile_begin}, {end}) are not a range of the map's {tiles} tiles")
    return end


def _tiles_into(op: str, tiles: Tensor, map_: Tensor, tile_begin: int, name: str) -> Tensor:
    _check_map(map_, op, name)
    channels = map_.shape[1]
    if (tiles.dim() != 3 or tiles.shape[0] not in POSITIONS.values() or tiles.shape[2] != channels
            or not tiles.is_contiguous()):
        raise ValueError(f"{op}: tiles must be a contiguous [16 or 36, T, {channels}] tensor, got "
                         f"{tuple(tiles.shape)}")
    if tiles.dtype != map_.dtype:
        raise ValueError(f"{op}: tiles are {tiles.dtype} but {name} is {map_.dtype}")
    _check_range(map_, tile_begin, tile_begin + tiles.shape[1], op, output_tile_of(tiles))
    if _compiled_on(map_):
        getattr(torch.ops.lit_amp_det, op)(tiles, map_, tile_begin)
    else:
        getattr(reference, op)(tiles, map_, tile_begin)
    return tiles


def winograd_input_tiles_(tiles: Tensor, input: Tensor, tile_begin: int = 0) -> Tensor:  # noqa: A002
    """Writes into ``tiles`` ``[16, T, C]`` (contiguous, ``input``'s dtype) ``B^T d B`` of the 4x4 tiles ``d`` of
    ``input`` zero-padded by 1, tiles ``[tile_begin, tile_begin + T)`` of the map's ``N * ceil(H/2) * ceil(W/2)`` in
    (image, tile row, tile column) order; computed in fp32 (fp64 for fp64) and rounded once. ``[36, T, C]`` tiles
    get F(4x4, 3x3)'s: the 6x6 tiles at stride 4, of the map's ``N * ceil(H/4) * ceil(W/4)``. Returns ``tiles``."""
    return _tiles_into("winograd_input_tiles_", tiles, input, tile_begin, "input")


def winograd_gradient_tiles_(tiles: Tensor, grad_output: Tensor, tile_begin: int = 0) -> Tensor:
    """Writes into ``tiles`` ``[16, T, C]`` ``G' g G'^T`` of the 2x2 tiles ``g`` of ``grad_output`` (zero past its
    edge), tiles ``[tile_begin, tile_begin + T)`` (``[36, T, C]``: of its 4x4 tiles, for F(4x4, 3x3)). Returns
    ``tiles``."""
    return _tiles_into("winograd_gradient_tiles_", tiles, grad_output, tile_begin, "grad_output")


def _new_tiles(map_: Tensor, op: str, name: str, tile_begin: int, tile_end: int | None, output_tile: int) -> Tensor:
    _check_map(map_, op, name)
    _check_output_tile(output_tile, op)
    end = _check_range(map_, tile_begin, tile_end, op, output_tile)
    return torch.empty((POSITIONS[output_tile], end - tile_begin, map_.shape[1]), dtype=map_.dtype,
                       device=map_.device)


def winograd_input_tiles(input: Tensor, tile_begin: int = 0, tile_end: int | None = None,  # noqa: A002
                         output_tile: int = 2) -> Tensor:
    """:func:`winograd_input_tiles_` into a new ``[16 or 36, tile_end - tile_begin, C]`` tensor (``None``: to the
    last tile; ``output_tile`` 2 or 4)."""
    tiles = _new_tiles(input, "winograd_input_tiles", "input", tile_begin, tile_end, output_tile)
    return winograd_input_tiles_(tiles, input, tile_begin)


def winograd_gradient_tiles(grad_output: Tensor, tile_begin: int = 0, tile_end: int | None = None,
                            output_tile: int = 2) -> Tensor:
    """:func:`winograd_gradient_tiles_` into a new ``[16 or 36, tile_end - tile_begin, C]`` tensor."""
    tiles = _new_tiles(grad_output, "winograd_gradient_tiles", "grad_output", tile_begin, tile_end, output_tile)
    return winograd_gradient_tiles_(tiles, grad_output, tile_begin)


def winograd_output_(out: Tensor, products: Tensor, bias: Tensor | None = None, tile_begin: int = 0) -> Tensor:
    """Writes into the channels_last map ``out`` ``[N, C, H, W]`` the output pixels of tiles ``[tile_begin,
    tile_begin + T)``: ``A^T m A`` of each tile's 16 products ``m`` (``products``: ``[16, T, C]``, ``out``'s
    dtype; ``[36, T, C]``: F(4x4, 3x3)'s 4x4 tiles) plus ``bias`` ``[C]``, rounded once. Returns ``out``."""
    _check_map(out, "winograd_output_", "out")
    if not out.is_contiguous(memory_format=torch.channels_last):
        raise ValueError("winograd_output_: out must be channels_last (out.contiguous(memory_format="
                         "torch.channels_last))")
    channels = out.shape[1]
    if products.dim() != 3 or products.shape[0] not in POSITIONS.values() or products.shape[2] != channels:
        raise ValueError(f"winograd_output_: products must be [16 or 36, T, {channels}], got "
                         f"{tuple(products.shape)}")
    if products.dtype != out.dtype:
        raise ValueError(f"winograd_output_: products are {products.dtype} but out is {out.dtype}")
    _check_range(out, tile_begin, tile_begin + products.shape[1], "winograd_output_", output_tile_of(products))
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"winograd_output_: bias must be [{channels}], got {tuple(bias.shape)}")
    if _compiled_on(products):
        torch.ops.lit_amp_det.winograd_output_(out, products, bias, tile_begin)
    else:
        reference.winograd_output_(out, products, bias, tile_begin)
    return out


def winograd_output(products: Tensor, batch_size: int, height: int, width: int, bias: Tensor | None = None) -> Tensor:
    """The channels_last ``[N, C, H, W]`` map of all its tiles' products ``[16 or 36, T, C]``
    (:func:`winograd_output_` into a new tensor)."""
    side = output_tile_of(products)
    tiles = tile_count(batch_size, height, width, side)
    if products.shape[1] != tiles:
        raise ValueError(f"winograd_output: products must be [{POSITIONS[side]}, {tiles}, C] for a "
                         f"[{batch_size}, C, {height}, {width}] map, got {tuple(products.shape)}")
    out = torch.empty((batch_size, products.shape[2], height, width), dtype=products.dtype, device=products.device,
                      memory_format=torch.channels_last)
    return winograd_output_(out, products, bias)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the transforms of a ``dtype`` tensor sum in: float64 for float64, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_weight(weight: Tensor, op: str, name: str) -> None:
    if weight.dim() != 4 or tuple(weight.shape[2:]) != (3, 3) or not weight.is_floating_point():
        raise ValueError(f"{op}: {name} must be [C_out, C_in, 3, 3] and floating point, got {weight.dtype} "
                         f"{tuple(weight.shape)}")


def winograd_weight_tiles(weight: Tensor, transposed: bool = False, out: Tensor | None = None,
                          output_tile: int = 2) -> Tensor:
    """``[16, C_in, C_out]``: ``G w G^T`` of each 3x3 filter of ``weight`` ``[C_out, C_in, 3, 3]``, the right-hand
    operands of the 16 products. ``transposed``: the filters of the input gradient's convolution instead (input and
    output channels swapped, filters rotated by 180 degrees): ``[16, C_out, C_in]``. ``out``: a contiguous tensor of
    that shape and the weight's dtype to write the tiles into (returned). ``output_tile=4``: F(4x4, 3x3)'s 36
    positions instead of 16. Computed in fp32 (fp64 for fp64) and rounded once; the weight is read in its own memory
    format (C++ kernel on the CPU; elsewhere, or without the extension, the plain-PyTorch reference)."""
    _check_weight(weight, "winograd_weight_tiles", "weight")
    _check_output_tile(output_tile, "winograd_weight_tiles")
    c_out, c_in = weight.shape[:2]
    shape = (POSITIONS[output_tile], *((c_out, c_in) if transposed else (c_in, c_out)))
    if out is None:
        out = torch.empty(shape, dtype=weight.dtype, device=weight.device)
    elif out.shape != shape or out.dtype != weight.dtype or not out.is_contiguous():
        raise ValueError(f"winograd_weight_tiles: out must be a contiguous [{shape[0]}, {shape[1]}, {shape[2]}] "
                         f"{weight.dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    if _compiled_on(weight):
        torch.ops.lit_amp_det.winograd_weight_tiles_(out, weight, transposed)
    else:
        reference.winograd_weight_tiles_(out, weight, transposed)
    return out


def winograd_weight_gradient(products: Tensor, like: Tensor, out: Tensor | None = None) -> Tensor:
    """The ``[C_out, C_in, 3, 3]`` weight gradient ``A'^T s A'`` from the 16 (or 36: F(4x4, 3x3)) products ``s``
    ``[16 or 36, C_out, C_in]`` of gradient tiles and input tiles (summed in fp32; fp64 for a fp64 ``like``), in
    ``like``'s dtype and memory format (the weight's), written into ``out`` when given (allocated before the
    temporaries, so that they free the top of the CPU heap again)."""
    _check_weight(like, "winograd_weight_gradient", "like")
    output_tile = output_tile_of(products)
    if tuple(products.shape[1:]) != tuple(like.shape[:2]):
        raise ValueError(f"winograd_weight_gradient: products must be [{POSITIONS[output_tile]}, {like.shape[0]}, "
                         f"{like.shape[1]}] for a {tuple(like.shape)} weight, got {tuple(products.shape)}")
    if out is not None and (out.shape != like.shape or out.dtype != like.dtype):
        raise ValueError(f"winograd_weight_gradient: out must be a {tuple(like.shape)} {like.dtype} tensor like the "
                         f"weight, got {tuple(out.shape)} {out.dtype}")
    target = torch.empty_like(like) if out is None else out
    sums = products.to(accumulation_dtype(like.dtype)).contiguous()
    if _compiled_on(like):
        torch.ops.lit_amp_det.winograd_weight_gradient_(target, sums)
    else:
        reference.winograd_weight_gradient_(target, sums)
    return target


if extension_available():

    def _tiles_fake(tiles: Tensor, map_: Tensor, tile_begin: int = 0) -> None:
        return None

    torch.library.register_fake("lit_amp_det::winograd_input_tiles_")(_tiles_fake)
    torch.library.register_fake("lit_amp_det::winograd_gradient_tiles_")(_tiles_fake)

    @torch.library.register_fake("lit_amp_det::winograd_output_")
    def _output_fake(out: Tensor, products: Tensor, bias: Tensor | None, tile_begin: int = 0) -> None:
        return None

    @torch.library.register_fake("lit_amp_det::winograd_weight_tiles_")
    def _weight_tiles_fake(tiles: Tensor, weight: Tensor, transposed: bool = False) -> None:
        return None

    @torch.library.register_fake("lit_amp_det::winograd_weight_gradient_")
    def _weight_gradient_fake(grad_weight: Tensor, products: Tensor) -> None:
        return None

"""Device-agnostic launchers of the Triton kernels: check inputs, allocate outputs, pick blocks, launch.

They are the CUDA kernels registered for ``torch.ops.lit_amp_det`` (:mod:`._register`). CUDA
tensors run the compiled kernels; CPU tensors run them through Triton's interpreter under
``TRITON_INTERPRET=1`` (so every kernel can be tested without a GPU). Only :func:`nms` / :func:`batched_nms`
synchronise with the host (their result size is data-dependent).

``torch.compile`` and ``torch.export`` see ``torch.ops.lit_amp_det`` as custom ops with fake kernels and run
these launchers only when the graph runs, eagerly; an eager launch goes straight to Triton's launcher. Only a
trace through the launchers themselves (calling them under ``torch.compile``,
``make_fx`` or non-strict export) records each launch with ``torch.library.wrap_triton`` (:func:`_launch`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType

import torch
from torch import Tensor

from lit_amp_det.ops.layout import suggest_memory_format

__all__ = [
    "batched_nms",
    "batched_nms_padded",
    "box_iou",
    "multi_level_roi_align",
    "multi_level_roi_align_backward",
    "nms",
    "nms_padded",
    "roi_align",
    "roi_align_backward",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTEGERS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
#: most boxes one NMS call takes: the greedy pass keeps one removed-bit per box in registers
MAX_NMS_BOXES = 64 * 4096
_INTERPRETED: ModuleType | None = None


# -- Which kernels: compiled for CUDA tensors, interpreted for CPU tensors
# ------------------------------------------
_KERNELS_MODULE = "lit_amp_det.ops.triton._kernels"


def _interpreted() -> ModuleType:
    """The kernels module loaded a second time with Triton's interpreter on (or the first one if it already
    is).
    """
    global _INTERPRETED
    if _INTERPRETED is None:
        from triton.runtime.interpreter import InterpretedFunction

        loaded = sys.modules.get(_KERNELS_MODULE)  # not imported here: that would fix its mode for CUDA too
        if loaded is not None and isinstance(loaded.box_iou_kernel, InterpretedFunction):
            _INTERPRETED = loaded
        else:
            _INTERPRETED = load_kernels(interpret=True)
            sys.modules[_INTERPRETED.__name__] = _INTERPRETED
    return _INTERPRETED


def load_kernels(interpret: bool) -> ModuleType:
    """A fresh copy of the kernels module, decorated for Triton's interpreter or for compilation whatever
    ``TRITON_INTERPRET`` said when the module was first imported (the AOT compile report takes the compiled
    one).
    """
    import triton

    name = _KERNELS_MODULE + ("_interpreted" if interpret else "_compiled")
    spec = importlib.util.spec_from_file_location(name, importlib.util.find_spec(_KERNELS_MODULE).origin)
    module = importlib.util.module_from_spec(spec)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = interpret
        spec.loader.exec_module(module)
    return module


def _kernels(device: torch.device) -> ModuleType:
    if device.type == "cuda":
        return importlib.import_module(_KERNELS_MODULE)
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                "lit_amp_det.ops.triton got CPU tensors: the Triton kernels run on CPU tensors only "
                "through Triton's interpreter, so set TRITON_INTERPRET=1 in the environment (slow; "
                "meant for tests), move the tensors to a GPU, or use lit_amp_det.ops (C++ CPU kernels) "
                "instead"
            )
        return _interpreted()
    raise RuntimeError(
        f"lit_amp_det.ops.triton runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got {device}"
    )


_GPU_CONFIGS_ON_CPU = False


@contextlib.contextmanager
def gpu_launch_configs() -> Iterator[None]:
    """For tests: within the block, CPU tensors (the interpreter) get the launch configurations of a CUDA
    device, so the block shapes a GPU runs are executed and checked without one.
    """
    global _GPU_CONFIGS_ON_CPU
    previous, _GPU_CONFIGS_ON_CPU = _GPU_CONFIGS_ON_CPU, True
    try:
        yield
    finally:
        _GPU_CONFIGS_ON_CPU = previous


def _gpu_configs(device: torch.device) -> bool:
    return device.type == "cuda" or _GPU_CONFIGS_ON_CPU


_INTERPRETED_FUNCTION: type | None = None


def _interpreted_function() -> type:
    """Triton's ``InterpretedFunction``, imported once: an import statement in every launch would add to its
    host time, and Dynamo warns about a ``functools.cache``.
    """
    global _INTERPRETED_FUNCTION
    if _INTERPRETED_FUNCTION is None:
        from triton.runtime.interpreter import InterpretedFunction

        _INTERPRETED_FUNCTION = InterpretedFunction
    return _INTERPRETED_FUNCTION


def _without_data(tensors: Sequence[Tensor]) -> bool:
    """Whether a tensor has no data of its own to launch on: fake, functional or another
    ``__torch_dispatch__`` subclass.
    """
    return any(type(t).__torch_dispatch__ is not Tensor.__torch_dispatch__ for t in tensors)


#: the dispatch modes of a trace (torch's own, each kept in its slot of the dispatch stack)
_TRACING_MODE_KEYS = (
    torch._C._TorchDispatchModeKey.PROXY,
    torch._C._TorchDispatchModeKey.FAKE,
    torch._C._TorchDispatchModeKey.FUNCTIONAL,
)


def _tracing_mode() -> bool:
    """Whether a tracing mode is on the dispatch stack: ``make_fx``'s proxy mode, fake tensors or
    functionalization (the modes ``wrap_triton``'s higher-order op has rules for; under any other
    ``TorchDispatchMode``, a profiler's counter, it raises ``NotImplementedError``).
    """
    if not torch._C._len_torch_dispatch_stack():  # the common case, one call
        return False
    return any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODE_KEYS)


def _launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """Launches ``kernel`` over ``grid`` on the device of its first tensor argument.

    A plain eager call launches the compiled kernel directly, through Triton's own launcher.
    ``torch.library.wrap_triton`` is taken only where a trace must record the launch as a
    ``triton_kernel_wrapper_mutation`` node: ``torch.compile``, ``make_fx`` and ``torch.export`` (fake
    tensors, functionalization). In eager mode that wrapper is a higher-order op through the dispatcher, many
    times the host time of the launch itself (``tools/triton_launch_overhead.py``), and it keeps every call's
    constant arguments in ``kernel_side_table`` for the life of the process, so plain calls must not take it.

    Args:
        kernel: a ``triton.jit`` kernel, compiled or interpreted (``TRITON_INTERPRET=1`` on CPU tensors).
        grid: the number of programs along each grid axis.
        *args: the kernel's arguments; its tensors all on one device.
        **meta: the kernel's constexpr arguments and launch options (``num_warps``).
    """
    if isinstance(kernel, _interpreted_function()):
        kernel[grid](*args, **meta)
        return
    tensors = [a for a in args if isinstance(a, Tensor)]
    # is_compiling first: Dynamo folds it to True and traces nothing after it
    if torch.compiler.is_compiling() or _without_data(tensors):
        # recorded, nothing runs: no device is made current (the graph places the launch where it runs)
        torch.library.wrap_triton(kernel)[grid](*args, enable_fp_fusion=False, **meta)
        return
    # real tensors under make_fx: recorded and run, so on their device like an eager launch
    launch = torch.library.wrap_triton(kernel) if _tracing_mode() else kernel
    # Triton 3.8's launcher has no device argument: it launches on torch.cuda.current_device() with that
    # device's current stream. Comparing first costs one lookup; a torch.cuda.device context costs two device
    # exchanges per launch, so it is entered only for tensors on another device than the current one.
    device = tensors[0].device.index
    if device == torch.cuda.current_device():
        launch[grid](*args, enable_fp_fusion=False, **meta)
        return
    with torch.cuda.device(device):
        launch[grid](*args, enable_fp_fusion=False, **meta)


def _acc_dtype(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float64: tl.float64, torch.int64: tl.int64}[dtype]


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-int(a) // int(b))


# -- box_iou
# --------------------------------------------------------------------------------------------------------
def _check_boxes(op: str, name: str, boxes: Tensor, *, integer_ok: bool = False) -> None:
    if boxes.dim() != 2 or boxes.shape[1] != 4:
        raise ValueError(
            f"{op}: {name} should be a 2-D tensor of shape [N, 4], got shape {list(boxes.shape)}"
        )
    if not (boxes.dtype in _FLOATS or (integer_ok and boxes.dtype in _INTEGERS)):
        kinds = "float16, bfloat16, float32 or float64" + (" or an integer type" if integer_ok else "")
        raise TypeError(f"{op}: {name} should be {kinds}, got {boxes.dtype}")


def box_iou(boxes1: Tensor, boxes2: Tensor) -> Tensor:
    """IoU matrix ``[N, M]``: float32 (float64 if an input is; integer boxes are exact, float32 out)."""
    _check_boxes("box_iou", "boxes1", boxes1, integer_ok=True)
    _check_boxes("box_iou", "boxes2", boxes2, integer_ok=True)
    if boxes1.device != boxes2.device:
        raise ValueError(
            f"box_iou: boxes1 and boxes2 should be on the same device, got {boxes1.device} and "
            f"{boxes2.device}"
        )
    integer = not boxes1.dtype.is_floating_point and not boxes2.dtype.is_floating_point
    acc = _acc_dtype(boxes1, boxes2)
    out = torch.empty((boxes1.shape[0], boxes2.shape[0]), dtype=acc, device=boxes1.device)
    if out.numel() == 0:
        return out
    a, b = boxes1, boxes2
    if integer:
        a, b = a.to(torch.int64), b.to(torch.int64)
    elif not a.dtype.is_floating_point or not b.dtype.is_floating_point:
        a, b = a.to(acc), b.to(acc)  # a float and an integer tensor: the integer one is compared as floats
    k = _kernels(out.device)
    block_n, block_m = (32, 64) if _gpu_configs(out.device) else (64, 128)
    grid = (_cdiv(out.shape[0], block_n), _cdiv(out.shape[1], block_m))
    _launch(
        k.box_iou_kernel,
        grid,
        a,
        b,
        out,
        out.shape[0],
        out.shape[1],
        *a.stride(),
        *b.stride(),
        ACC=_tl_dtype(torch.int64 if integer else acc),
        FP64=acc == torch.float64,
        INT=integer,
        BLOCK_N=block_n,
        BLOCK_M=block_m,
    )
    return out


# -- NMS
# ------------------------------------------------------------------------------------------------------------
def _check_nms_inputs(op: str, boxes: Tensor, scores: Tensor, idxs: Tensor | None) -> None:
    _check_boxes(op, "boxes", boxes)
    if scores.dim() != 1 or scores.shape[0] != boxes.shape[0]:
        raise ValueError(
            f"{op}: scores should be a 1-D tensor of shape [{boxes.shape[0]}] (one per box), "
            f"got shape {list(scores.shape)}"
        )
    if scores.dtype not in _FLOATS:
        raise TypeError(f"{op}: scores should be float16, bfloat16, float32 or float64, got {scores.dtype}")
    if scores.device != boxes.device:
        raise ValueError(
            f"{op}: boxes and scores should be on the same device, got boxes on {boxes.device} "
            f"and scores on {scores.device}"
        )
    if idxs is not None:
        if idxs.dim() != 1 or idxs.shape[0] != boxes.shape[0]:
            raise ValueError(
                f"{op}: idxs should be a 1-D tensor of shape [{boxes.shape[0]}] (one class per box), "
                f"got shape {list(idxs.shape)}"
            )
        if idxs.dtype not in _INTEGERS:
            raise TypeError(f"{op}: idxs should be an integer tensor (int64 class ids), got {idxs.dtype}")
        if idxs.device != boxes.device:
            raise ValueError(
                f"{op}: idxs should be on the same device as boxes ({boxes.device}), got {idxs.device}"
            )
    if boxes.shape[0] > MAX_NMS_BOXES:
        raise ValueError(
            f"{op}: at most {MAX_NMS_BOXES} boxes per call, got {boxes.shape[0]}; pre-select the "
            "top-scoring boxes first (e.g. scores.topk)"
        )


def _kept_flags(
    boxes: Tensor,
    scores: Tensor,
    idxs: Tensor | None,
    iou_threshold: float,
    limit: int,
    valid: Tensor | None,
    max_class_size: int | None,
) -> tuple[Tensor, Tensor]:
    """Greedy NMS on the device: (indices by decreasing score, kept flag of each of them)."""
    n = boxes.shape[0]
    device = boxes.device
    order = torch.sort(scores, descending=True, stable=True).indices  # ties: lower index first
    if idxs is None:
        visit = order  # one class: visit by score
        cls = torch.zeros(n, dtype=torch.int64, device=device)
        class_end = torch.full((n,), n, dtype=torch.int64, device=device)
        by_class = None
    else:
        # classes apart: group by class (stable, so each class stays in score order)
        by_class = torch.sort(idxs[order].to(torch.int64), stable=True)
        visit = order[by_class.indices]
        cls = by_class.values.contiguous()
        class_end = torch.searchsorted(cls, cls, right=True)
    acc = _acc_dtype(boxes)
    words = _cdiv(n, 64)
    # words a row of the mask spans: up to the end of its class, which the caller may bound
    band = words if max_class_size is None else min(words, (max(int(max_class_size), 1) - 1) // 64 + 2)
    k = _kernels(device)
    # a device scalar (a fill, no host-to-device copy); float64, so the comparison is with the exact threshold
    threshold = torch.full((1,), float(iou_threshold), dtype=torch.float64, device=device)
    mask = torch.empty(
        (n, band), dtype=torch.int64, device=device
    )  # only tiles the greedy pass reads are written
    _launch(
        k.nms_mask_kernel,
        (band, words),
        boxes,
        boxes.stride(0),
        boxes.stride(1),
        visit,
        cls,
        threshold,
        mask,
        n,
        words,
        band,
        ACC=_tl_dtype(acc),
        FP64=acc == torch.float64,
        num_warps=NMS_MASK_WARPS,
    )
    # the greedy pass's initial removed bits, one int64 per 64 boxes in visiting order: not ``valid``, or past
    # n
    removed = torch.ones(words * 64, dtype=torch.int64, device=visit.device)
    removed[:n] = 0 if valid is None else (~valid[visit]).to(torch.int64)
    shifts = torch.arange(64, dtype=torch.int64, device=visit.device)
    removed = (removed.view(words, 64) << shifts).sum(1)  # distinct bits: the sum is the OR (bit 63 wraps)
    keep_visit = torch.zeros(n, dtype=torch.int8, device=device)
    # one warp keeps the per-box reductions of the serial pass inside a warp, while the removed bits fit
    words_block = max(_next_pow2(words), 16)
    _launch(
        k.nms_greedy_kernel,
        (1,),
        mask,
        removed,
        cls,
        class_end,
        keep_visit,
        n,
        words,
        band,
        limit,
        WORDS_BLOCK=words_block,
        num_warps=1 if words_block <= 512 else 4,
    )
    if by_class is None:
        return order, keep_visit
    keep_by_score = torch.empty_like(keep_visit)
    keep_by_score[by_class.indices] = keep_visit
    return order, keep_by_score


def _nms_padded(
    boxes, scores, idxs, iou_threshold, max_output, op, valid=None, max_class_size=None
) -> tuple[Tensor, Tensor]:
    _check_nms_inputs(op, boxes, scores, idxs)
    n = boxes.shape[0]
    if valid is not None and (
        valid.dtype != torch.bool or valid.shape != (n,) or valid.device != boxes.device
    ):
        raise ValueError(
            f"{op}: valid should be a bool tensor of shape [{n}] on {boxes.device}, got "
            f"{valid.dtype} {list(valid.shape)} on {valid.device}"
        )
    limit = n if max_output < 0 else min(n, int(max_output))
    if limit == 0:
        return (
            torch.empty(0, dtype=torch.int64, device=boxes.device),
            torch.zeros((), dtype=torch.int64, device=boxes.device),
        )
    order, keep = _kept_flags(boxes, scores, idxs, iou_threshold, limit, valid, max_class_size)
    # kept indices in score order, padded with -1 to `limit`, and their count; on the device, no sync
    position = torch.cumsum(keep, 0, dtype=torch.int64) - 1
    slot = torch.where((keep != 0) & (position < limit), position, limit)
    padded = torch.full((limit + 1,), -1, dtype=torch.int64, device=order.device)
    padded.scatter_(0, slot, order)  # every dropped box lands in the extra slot `limit`, cut below
    count = (position[-1] + 1).clamp(max=limit)
    return padded[:limit], count


def nms_padded(
    boxes: Tensor, scores: Tensor, iou_threshold: float, max_output: int = -1, *, valid: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """NMS without host synchronisation: ``(keep [L] int64 padded with -1, count 0-d int64)``,
    ``L = min(N, max_output)``; boxes with ``valid`` False (bool ``[N]``) neither are kept nor suppress.
    """
    return _nms_padded(boxes, scores, None, iou_threshold, max_output, "nms", valid)


def batched_nms_padded(
    boxes: Tensor,
    scores: Tensor,
    idxs: Tensor,
    iou_threshold: float,
    max_output: int = -1,
    *,
    valid: Tensor | None = None,
    max_class_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-class NMS without host synchronisation; same result layout as :func:`nms_padded`.

    ``max_class_size``, when the caller knows that no class has more boxes, bounds the IoU mask to
    ``N x (max_class_size / 64 + 2)`` words instead of ``N x N / 64``.
    """
    return _nms_padded(boxes, scores, idxs, iou_threshold, max_output, "batched_nms", valid, max_class_size)


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float, max_output: int = -1) -> Tensor:
    """Kept indices (int64) by decreasing score; reads the kept count once (the result size is
    data-dependent).
    """
    keep, count = nms_padded(boxes, scores, iou_threshold, max_output)
    return keep[: int(count)]


def batched_nms(
    boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float, max_output: int = -1
) -> Tensor:
    keep, count = batched_nms_padded(boxes, scores, idxs, iou_threshold, max_output)
    return keep[: int(count)]


# -- RoIAlign
# -------------------------------------------------------------------------------------------------------
def _check_feature(op: str, name: str, t: Tensor) -> None:
    if t.dim() != 4:
        raise ValueError(f"{op}: {name} must be a 4-D [N, C, H, W] tensor, got {t.dim()}-D")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{op}: {name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def _check_rois(op: str, rois: Tensor, device: torch.device) -> None:
    if rois.dim() != 2 or rois.shape[1] != 5:
        raise ValueError(
            f"{op}: rois must be a [K, 5] tensor of (batch_index, x1, y1, x2, y2), got shape "
            f"{list(rois.shape)}"
        )
    if not rois.dtype.is_floating_point:
        raise TypeError(f"{op}: rois must be floating point, got {rois.dtype}")
    if rois.device != device:
        raise ValueError(f"{op}: rois must be on the features' device {device}, got {rois.device}")


def _check_pool(op: str, pooled_height: int, pooled_width: int) -> None:
    if pooled_height <= 0 or pooled_width <= 0:
        raise ValueError(
            f"{op}: pooled_height and pooled_width must be > 0, got {pooled_height} and {pooled_width}"
        )


#: RoIAlign on a GPU: elements (bins x channels) per program and per thread. Each element holds four gathered
#: corners, their weights and 64-bit addresses in registers, so registers follow them: at 2 (512 over 8 warps;
#: larger pools get more warps) every fp16/bf16/fp32 forward and backward at the model's pools compiles
#: without a spill on sm_80/90/100 (``make gpu-compile``); 4 spilled bytes on each in some specialisation, 32
#: (4,096 over 4 warps) kilobytes.
GPU_TILE, GPU_ELEMENTS_PER_THREAD = 512, 2
#: warps of an NMS mask program (one 64 x 64 tile of IoUs, 8 a thread): at 4 warps ptxas took all 255
#: registers and spilled on sm_100, at 8 it still spilled on sm_80
NMS_MASK_WARPS = 16


def _blocks(channels: int, bins: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_C, num_warps) of a RoIAlign launch: all bins of one RoI, as many channels as the tile
    holds.
    """
    block_p = _next_pow2(bins)
    if not _gpu_configs(device):  # the interpreter: fewer, larger programs (each costs Python overhead)
        return block_p, max(1, min(_next_pow2(channels), 64)), 4
    block_c = max(1, min(_next_pow2(channels), GPU_TILE // block_p))
    return block_p, block_c, max(4, block_p * block_c // (32 * GPU_ELEMENTS_PER_THREAD))


#: the deterministic backward's tile side on a GPU: larger tiles mean fewer programs (each checks every RoI)
#: but longer walks where RoIs pile up, as on the coarse FPN levels (``python tools/owned_backward_cost.py``
#: counts both)
OWNED_TILE = 16


def _owned_blocks(channels: int, height: int, width: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_C, num_warps, tile_h, tile_w) of the deterministic backward: one warp of channel lanes and
    ``OWNED_TILE``-pixel tiles on a GPU; in the interpreter (every program costs Python overhead) one tile a
    map.
    """
    if _gpu_configs(device):
        return max(1, min(_next_pow2(channels), 32)), 1, OWNED_TILE, OWNED_TILE
    return max(1, min(_next_pow2(channels), 64)), 4, height, width


def _scale_tensors(scales: Sequence[float], acc: torch.dtype, device: torch.device) -> list[Tensor]:
    # one fill kernel each, no host-to-device copy (which would synchronise)
    return [torch.full((1,), float(s), dtype=acc, device=device) for s in scales]


def _levels_or_dummy(levels: Tensor | None, rois: Tensor) -> Tensor:
    return levels if levels is not None else rois  # never read without HAS_LEVELS


def _forward(
    features: Sequence[Tensor],
    rois: Tensor,
    levels: Tensor | None,
    spatial_scales: Sequence[float],
    pooled_height: int,
    pooled_width: int,
    sampling_ratio: int,
    aligned: bool,
) -> Tensor:
    first = features[0]
    num_rois, channels = rois.shape[0], first.shape[1]
    out = torch.empty(
        (num_rois, channels, pooled_height, pooled_width),
        dtype=first.dtype,
        device=first.device,
        memory_format=suggest_memory_format(first),
    )
    if out.numel() == 0:
        return out
    acc = _acc_dtype(first)
    k = _kernels(first.device)
    block_p, block_c, warps = _blocks(channels, pooled_height * pooled_width, first.device)
    grid = (num_rois, _cdiv(channels, block_c))
    if any(x.shape[2] == 0 or x.shape[3] == 0 for x in features):
        out.zero_()  # an empty map has no samples: its rows stay 0 (the kernels assume H, W > 0)
    for level, (x, scale) in enumerate(zip(features, _scale_tensors(spatial_scales, acc, first.device))):
        if x.shape[2] == 0 or x.shape[3] == 0:
            continue
        _launch(
            k.roi_align_forward_kernel,
            grid,
            x,
            rois,
            _levels_or_dummy(levels, rois),
            scale,
            out,
            level,
            len(features),
            x.shape[0],
            channels,
            x.shape[2],
            x.shape[3],
            *x.stride(),
            *rois.stride(),
            *out.stride(),
            pooled_height,
            pooled_width,
            int(sampling_ratio),
            ALIGNED=bool(aligned),
            HAS_LEVELS=levels is not None,
            ACC=_tl_dtype(acc),
            FP64=acc == torch.float64,
            BLOCK_P=block_p,
            BLOCK_C=block_c,
            num_warps=warps,
        )
    return out


def _backward(
    grad: Tensor,
    rois: Tensor,
    levels: Tensor | None,
    spatial_scales: Sequence[float],
    specs: Sequence[tuple[Sequence[int], torch.memory_format]],
    pooled_height: int,
    pooled_width: int,
    sampling_ratio: int,
    aligned: bool,
) -> list[Tensor]:
    """A gradient per level, of shape/format ``specs[l]`` and grad's dtype, accumulated in fp32 (fp64)."""
    acc = _acc_dtype(grad)
    # the accumulation buffers get the gradient's layout explicitly (torch.zeros would drop it)
    buffers = [
        torch.empty(tuple(shape), dtype=acc, device=grad.device, memory_format=fmt).zero_()
        for shape, fmt in specs
    ]
    num_rois = rois.shape[0]
    channels = specs[0][0][1]
    if num_rois and channels and grad.numel():
        k = _kernels(grad.device)
        deterministic = torch.are_deterministic_algorithms_enabled()
        block_p, block_c, warps = _blocks(channels, pooled_height * pooled_width, grad.device)
        for level, (gx, scale) in enumerate(zip(buffers, _scale_tensors(spatial_scales, acc, grad.device))):
            if gx.numel() == 0:
                continue
            common = dict(
                ALIGNED=bool(aligned),
                HAS_LEVELS=levels is not None,
                ACC=_tl_dtype(acc),
                FP64=acc == torch.float64,
            )
            sizes = (gx.shape[0], channels, gx.shape[2], gx.shape[3])
            tail = (
                *grad.stride(),
                *rois.stride(),
                *gx.stride(),
                pooled_height,
                pooled_width,
                int(sampling_ratio),
            )
            if deterministic:  # programs own tiles of gx: every sum has one fixed order
                owned_c, owned_warps, tile_h, tile_w = _owned_blocks(
                    channels, gx.shape[2], gx.shape[3], grad.device
                )
                tiles = _cdiv(gx.shape[2], tile_h) * _cdiv(gx.shape[3], tile_w)
                _launch(
                    k.roi_align_backward_owned_kernel,
                    (gx.shape[0] * tiles, _cdiv(channels, owned_c)),
                    grad,
                    rois,
                    _levels_or_dummy(levels, rois),
                    scale,
                    gx,
                    level,
                    len(specs),
                    num_rois,
                    *sizes,
                    *tail,
                    tile_h,
                    tile_w,
                    BLOCK_C=owned_c,
                    num_warps=owned_warps,
                    **common,
                )
            else:
                _launch(
                    k.roi_align_backward_atomic_kernel,
                    (num_rois, _cdiv(channels, block_c)),
                    grad,
                    rois,
                    _levels_or_dummy(levels, rois),
                    scale,
                    gx,
                    level,
                    len(specs),
                    *sizes,
                    *tail,
                    BLOCK_P=block_p,
                    BLOCK_C=block_c,
                    num_warps=warps,
                    **common,
                )
    return [b.to(grad.dtype) for b in buffers]  # .to keeps each buffer's layout


def roi_align(
    input: Tensor,
    rois: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    sampling_ratio: int,
    aligned: bool,
) -> Tensor:
    """The schema of ``lit_amp_det::roi_align``: ``[K, C, ph, pw]`` in the input dtype and layout."""
    _check_feature("roi_align", "input", input)
    _check_rois("roi_align", rois, input.device)
    _check_pool("roi_align", pooled_height, pooled_width)
    return _forward(
        [input], rois, None, [spatial_scale], pooled_height, pooled_width, sampling_ratio, aligned
    )


def roi_align_backward(
    grad: Tensor,
    rois: Tensor,
    spatial_scale: float,
    pooled_height: int,
    pooled_width: int,
    batch_size: int,
    channels: int,
    height: int,
    width: int,
    sampling_ratio: int,
    aligned: bool,
) -> Tensor:
    """The schema of ``lit_amp_det::_roi_align_backward``: grad_input in grad's dtype and
    ``suggest_memory_format``.
    """
    op = "_roi_align_backward"
    _check_feature(op, "grad", grad)
    _check_rois(op, rois, grad.device)
    _check_pool(op, pooled_height, pooled_width)
    expected = (rois.shape[0], channels, pooled_height, pooled_width)
    if tuple(grad.shape) != expected:
        raise ValueError(
            f"{op}: grad must be [K, C, pooled_height, pooled_width] = {list(expected)}, got "
            f"{list(grad.shape)}"
        )
    spec = ((batch_size, channels, height, width), suggest_memory_format(grad))
    return _backward(
        grad, rois, None, [spatial_scale], [spec], pooled_height, pooled_width, sampling_ratio, aligned
    )[0]


def _check_multi_level(
    op: str,
    features: Sequence[Tensor],
    rois: Tensor,
    levels: Tensor,
    spatial_scales: Sequence[float],
    pooled_height: int,
    pooled_width: int,
) -> None:
    if len(features) == 0:
        raise ValueError(f"{op}: features must hold at least one level, got none")
    for i, f in enumerate(features):
        _check_feature(op, f"features[{i}]", f)
        if (
            f.dtype != features[0].dtype
            or f.shape[:2] != features[0].shape[:2]
            or f.device != features[0].device
        ):
            raise ValueError(
                f"{op}: all levels must share N, C, dtype and device; features[0] is "
                f"{list(features[0].shape)} {features[0].dtype} on {features[0].device}, features[{i}] is "
                f"{list(f.shape)} {f.dtype} on {f.device}"
            )
    _check_rois(op, rois, features[0].device)
    if levels.dtype != torch.int64 or levels.shape != rois.shape[:1] or levels.device != rois.device:
        raise ValueError(
            f"{op}: levels must be int64 [K] with K = {rois.shape[0]} on {rois.device}, got "
            f"{levels.dtype} {list(levels.shape)} on {levels.device}"
        )
    if len(spatial_scales) != len(features):
        raise ValueError(
            f"{op}: got {len(features)} feature levels but {len(spatial_scales)} spatial_scales; "
            "pass one scale per level"
        )
    _check_pool(op, pooled_height, pooled_width)


def multi_level_roi_align(
    features: Sequence[Tensor],
    rois: Tensor,
    levels: Tensor,
    spatial_scales: Sequence[float],
    pooled_height: int,
    pooled_width: int,
    sampling_ratio: int,
    aligned: bool,
) -> Tensor:
    """The schema of ``lit_amp_det::multi_level_roi_align``: a launch per level, each writing its own rows."""
    _check_multi_level(
        "multi_level_roi_align", features, rois, levels, spatial_scales, pooled_height, pooled_width
    )
    return _forward(
        list(features), rois, levels, spatial_scales, pooled_height, pooled_width, sampling_ratio, aligned
    )


def multi_level_roi_align_backward(
    grad: Tensor,
    features: Sequence[Tensor],
    rois: Tensor,
    levels: Tensor,
    spatial_scales: Sequence[float],
    pooled_height: int,
    pooled_width: int,
    sampling_ratio: int,
    aligned: bool,
) -> list[Tensor]:
    """The schema of ``lit_amp_det::_multi_level_roi_align_backward``: a gradient per level, in its layout."""
    op = "_multi_level_roi_align_backward"
    _check_multi_level(op, features, rois, levels, spatial_scales, pooled_height, pooled_width)
    if grad.dtype != features[0].dtype:
        raise TypeError(f"{op}: grad must have the features' dtype {features[0].dtype}, got {grad.dtype}")
    specs = [(tuple(f.shape), suggest_memory_format(f)) for f in features]
    return _backward(
        grad, rois, levels, spatial_scales, specs, pooled_height, pooled_width, sampling_ratio, aligned
    )

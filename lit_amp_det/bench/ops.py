"""``python -m lit_amp_det bench ops``: lit_amp_det's kernels against torchvision's, op by op.

Each row times our op and the torchvision call it replaces on the same inputs, in this one process,
alternating the two in every repeat (so drift hits both), after warm-up calls; the table reports medians
and ``speed-up = torchvision median / ours median``. Sizes are Mask R-CNN's at 800 x 1216 (batch 2):

* ``nms rpn``: 12000 proposals, IoU 0.7, 2000 kept -- ours stops at 2000, torchvision runs NMS then slices.
* ``batched_nms rpn``: the RPN's real call, 5 FPN levels x 2000 candidates, NMS per level, 2000 kept.
* ``batched_nms det``: detection post-processing, 5000 (box, class) pairs over 80 classes, 100 kept.
* ``nms full``: 5000 boxes, no limit (the pure kernel speed).
* ``box_iou``: the RPN matcher (20 ground-truth boxes x 240k anchors) and the RoI matcher (20 x 2000).
* ``roi_align``: box head (512 RoIs, 7x7) and mask head (128 RoIs, 14x14) on a stride-8 map of 256 channels;
  forward and forward+backward; fp32, channels_last fp32, and bf16/fp16 (torchvision under autocast: its half
  path).
* ``MultiScaleRoIAlign``: 4 FPN levels, 1024 RoIs, 256 channels, forward+backward.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import Tensor

import lit_amp_det.ops as ops
from lit_amp_det.bench.e2e import device_name
from lit_amp_det.profiling import timed

__all__ = ["main"]

IMAGE = (800, 1216)
STRIDES = (4, 8, 16, 32)
#: (op, size, dtype / layout, ours, torchvision's): one row of the table
OpCase = tuple[str, str, str, Callable[[], Any], Callable[[], Any]]


def _boxes(n: int, clusters: int, seed: int, max_size: float = 300.0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    size = 4 + torch.rand(n, 2, generator=g) * (max_size - 4)
    centres = torch.rand(clusters, 2, generator=g) * torch.tensor([IMAGE[1], IMAGE[0]])
    centre = (
        centres[torch.randint(clusters, (n,), generator=g)] + torch.randn(n, 2, generator=g) * 0.15 * size
    )
    return torch.cat([centre - size / 2, centre + size / 2], dim=1)


def _scores(n: int, seed: int) -> Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def _rois(k: int, seed: int) -> Tensor:
    """``k`` RoIs ``Tensor[K, 5]`` over a batch of two images, as RoIAlign takes them: each row the index of
    its image (as a float) and a box ``x1, y1, x2, y2``.

    The boxes are clustered, as proposals are, and both columns come from ``seed``, so that ours and
    torchvision's pool the same regions in every run.
    """
    boxes = _boxes(k, 30, seed, max_size=600)
    batch_index = torch.randint(2, (k, 1), generator=torch.Generator().manual_seed(seed)).float()
    return torch.cat([batch_index, boxes], 1)


def _compare(
    name: str,
    size: str,
    dtype: str,
    ours: Callable[[], Any],
    theirs: Callable[[], Any],
    *,
    device: str,
    repeats: int,
    warmup: int,
) -> dict[str, Any]:
    for _ in range(warmup):
        ours(), theirs()
    ours_s, theirs_s = [], []
    for _ in range(repeats):
        ours_s.append(timed(ours, device))
        theirs_s.append(timed(theirs, device))
    mine, tv = statistics.median(ours_s), statistics.median(theirs_s)
    return {
        "op": name,
        "size": size,
        "dtype": dtype,
        "device": device,
        "ours_ms": 1000 * mine,
        "torchvision_ms": 1000 * tv,
        "speedup": tv / mine,
        "ours_spread_ms": 1000 * (max(ours_s) - min(ours_s)),
        "repeats": repeats,
    }


def _backward(fn: Callable[[], Tensor], inputs: Sequence[Tensor]) -> Callable[[], None]:
    def step() -> None:
        out = fn()
        torch.autograd.grad(out, list(inputs), torch.ones_like(out))

    return step


def _fwd_bwd(
    op: str,
    size: str,
    label: str,
    ours: Callable[[], Tensor],
    theirs: Callable[[], Tensor],
    inputs: Sequence[Tensor],
    device: str,
    autocast: torch.dtype | None,
) -> list[OpCase]:
    """The forward and the forward+backward case (gradients of ``inputs``) of one op; torchvision's side under
    ``torch.autocast`` to ``autocast`` when given, which is how it gets half inputs.
    """
    context = (lambda: torch.autocast(device, dtype=autocast)) if autocast is not None else nullcontext

    def tv() -> Tensor:
        with context():
            return theirs()

    return [
        (f"{op} fwd", size, label, lambda: ours().detach(), lambda: tv().detach()),
        (f"{op} fwd+bwd", size, label, _backward(ours, inputs), _backward(tv, inputs)),
    ]


def _nms_cases(device: str) -> list[OpCase]:
    rpn_boxes, rpn_scores = _boxes(12000, 300, 0).to(device), _scores(12000, 0).to(device)
    level_boxes = torch.cat([_boxes(2000, 60, seed) for seed in range(5)]).to(device)
    level_scores = _scores(10000, 1).to(device)
    levels = torch.arange(5, device=device).repeat_interleave(2000)
    det_boxes, det_scores = _boxes(5000, 100, 2).to(device), _scores(5000, 2).to(device)
    labels = torch.randint(80, (5000,), generator=torch.Generator().manual_seed(2)).to(device)
    full_boxes, full_scores = _boxes(5000, 100, 3).to(device), _scores(5000, 3).to(device)
    tv = torchvision.ops
    return [
        (
            "nms rpn (max_output)",
            "12000 -> 2000, IoU 0.7",
            "fp32",
            lambda: ops.nms(rpn_boxes, rpn_scores, 0.7, 2000),
            lambda: tv.nms(rpn_boxes, rpn_scores, 0.7)[:2000],
        ),
        (
            "batched_nms rpn (max_output)",
            "5 levels x 2000 -> 2000",
            "fp32",
            lambda: ops.batched_nms(level_boxes, level_scores, levels, 0.7, 2000),
            lambda: tv.batched_nms(level_boxes, level_scores, levels, 0.7)[:2000],
        ),
        (
            "batched_nms det (max_output)",
            "5000 over 80 classes -> 100",
            "fp32",
            lambda: ops.batched_nms(det_boxes, det_scores, labels, 0.5, 100),
            lambda: tv.batched_nms(det_boxes, det_scores, labels, 0.5)[:100],
        ),
        (
            "nms full",
            "5000, IoU 0.5",
            "fp32",
            lambda: ops.nms(full_boxes, full_scores, 0.5),
            lambda: tv.nms(full_boxes, full_scores, 0.5),
        ),
    ]


def _iou_cases(device: str) -> list[OpCase]:
    gt = _boxes(20, 20, 4).to(device)
    anchors = _boxes(240_000, 1000, 5).to(device)
    proposals = _boxes(2000, 100, 6).to(device)
    return [
        (
            "box_iou",
            "20 x 240000 (RPN matcher)",
            "fp32",
            lambda: ops.box_iou(gt, anchors),
            lambda: torchvision.ops.box_iou(gt, anchors),
        ),
        (
            "box_iou",
            "20 x 2000 (RoI matcher)",
            "fp32",
            lambda: ops.box_iou(gt, proposals),
            lambda: torchvision.ops.box_iou(gt, proposals),
        ),
    ]


def _roi_align_cases(device: str, half: torch.dtype) -> list[OpCase]:
    cases = []
    base = torch.randn(2, 256, IMAGE[0] // 8, IMAGE[1] // 8, generator=torch.Generator().manual_seed(7)).to(
        device
    )
    variants = [
        ("fp32", base, torch.contiguous_format, None),
        ("fp32 channels_last", base, torch.channels_last, None),
        (f"{str(half).split('.')[-1]} (tv: autocast)", base.to(half), torch.contiguous_format, half),
    ]
    for head, k, out in (("box head", 512, 7), ("mask head", 128, 14)):
        rois = _rois(k, 8).to(device)
        size = f"{head}: {k} RoIs {out}x{out}, 2x256x{IMAGE[0] // 8}x{IMAGE[1] // 8}"
        for label, features, layout, autocast in variants:
            x = features.contiguous(memory_format=layout).requires_grad_()
            args = (x, rois, out, 0.125, 2)
            cases += _fwd_bwd(
                "roi_align",
                size,
                label,
                functools.partial(ops.roi_align, *args),
                functools.partial(torchvision.ops.roi_align, *args),
                [x],
                device,
                autocast,
            )
    return cases


def _pooler_cases(device: str, half: torch.dtype) -> list[OpCase]:
    names = [str(i) for i in range(len(STRIDES))]
    g = torch.Generator().manual_seed(9)
    boxes = [_boxes(512, 40, seed, max_size=700).clamp(min=0).to(device) for seed in (10, 11)]
    shapes = [IMAGE, IMAGE]
    ours_pool = ops.MultiScaleRoIAlign(names, 7, 2)
    tv_pool = torchvision.ops.MultiScaleRoIAlign(names, 7, 2)
    cases = []
    half_label = f"{str(half).split('.')[-1]} (tv: autocast)"
    for label, dtype, autocast in (("fp32", torch.float32, None), (half_label, half, half)):
        features = {
            n: torch.randn(2, 256, IMAGE[0] // s, IMAGE[1] // s, generator=g)
            .to(device, dtype)
            .requires_grad_()
            for n, s in zip(names, STRIDES)
        }
        args = (features, boxes, shapes)
        cases += _fwd_bwd(
            "MultiScaleRoIAlign",
            "4 levels, 1024 RoIs 7x7, 256 channels",
            label,
            functools.partial(ours_pool, *args),
            functools.partial(tv_pool, *args),
            list(features.values()),
            device,
            autocast,
        )
    return cases


def _table(rows: list[dict[str, Any]], header: str) -> str:
    """The report: ``header``, then a markdown table with a line per op case of ``rows``: both medians in ms
    and the speed-up of ours over torchvision's.
    """
    lines = [
        header,
        "| op | size | dtype / layout | ours ms | torchvision ms | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['op']} | {r['size']} | {r['dtype']} | {r['ours_ms']:.2f} | {r['torchvision_ms']:.2f} "
        f"| **{r['speedup']:.2f}x** |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lit_amp_det bench ops",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed calls per op (default 15 CPU, 50 CUDA)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--only", default="", help="comma-separated groups: nms,iou,roi_align,pooler (default all)"
    )
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if not ops.extension_available():
        raise SystemExit(
            f"bench ops compares the compiled kernels, but lit_amp_det._C is not built "
            f"({ops.extension_error()}). Run `make install` first."
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device=cuda but torch sees no GPU; use --device=cpu")
    repeats = args.repeats or (50 if args.device == "cuda" else 15)
    half = torch.float16 if args.device == "cuda" else torch.bfloat16
    groups = {
        "nms": _nms_cases,
        "iou": _iou_cases,
        "roi_align": functools.partial(_roi_align_cases, half=half),
        "pooler": functools.partial(_pooler_cases, half=half),
    }
    chosen = [g.strip() for g in args.only.split(",") if g.strip()] or list(groups)
    if unknown := sorted(set(chosen) - set(groups)):
        raise SystemExit(f"--only: unknown group(s) {unknown}; choose from {sorted(groups)}")
    torch.manual_seed(0)
    rows = []
    for group in chosen:
        for name, size, dtype, ours, theirs in groups[group](args.device):
            rows.append(
                _compare(
                    name, size, dtype, ours, theirs, device=args.device, repeats=repeats, warmup=args.warmup
                )
            )
            print(f"  {name} [{size}, {dtype}]: {rows[-1]['speedup']:.2f}x", flush=True)
    header = (
        f"device={args.device} ({device_name(args.device)}) torch={torch.__version__} "
        f"torchvision={torchvision.__version__} repeats={repeats} (median; warm-up {args.warmup} excluded)"
    )
    print(_table(rows, header))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": header, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

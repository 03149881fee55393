"""``python -m lit_amp_det bench ops``: lit_amp_det's kernels against torchvision's, op by op.

Each row times our op and the torchvision call it replaces on the same inputs, in this one process,
alternating the two in every repeat (so drift hits both), after warm-up calls; the table reports medians
and ``speed-up = torchvision median / ours median``. Sizes are Mask R-CNN's at 800 x 1216 (batch 2):

* ``nms rpn``: 12000 proposals, IoU 0.7, 2000 kept -- ours stops at 2000, torchvision runs NMS then slices.
* ``batched_nms rpn``: the RPN's real call, 5 FPN levels x 2000 candidates, NMS per level, 2000 kept.
* ``batched_nms det``: detection post-processing, 5000 (box, class) pairs over 80 classes, 100 kept.
* ``nms full``: 5000 boxes, no limit (the pure kernel speed).
* ``box_iou``: the RPN matcher (20 ground-truth boxes x 240k anchors) and the RoI matcher (20 x 2000).
* ``roi_align``: box head (512 RoIs, 7x7) and mask head (128 RoIs, 14x14) on a stride-8 map of 256
  channels; forward and forward+backward; fp32, channels_last fp32, and bf16/fp16 (torchvision under
  autocast, which is how it gets half inputs).
* ``MultiScaleRoIAlign``: 4 FPN levels, 1024 RoIs, 256 channels, forward+backward.
* ``winograd`` (CPU): ``model.winograd_convs``' F(2x2, 3x3) convolution against torch's own ``F.conv2d`` (oneDNN) on
  channels_last maps, forward+backward, at the layers it is for: the R50-FPN mask head (70 RoIs of 14x14, 256
  channels) and FPN/RPN level P2 at 256 px (2 x 256 x 64x64), ResNet-18 stages 1-3 and the light FPN's P2 at 224 px
  (batch 4); in fp32, and in bf16 where the CPU computes bf16 natively (elsewhere bf16 convolutions are slow paths,
  see ``lit_amp_det.precision.hardware``).
* ``winograd_sizes`` (CPU): the same A/B over a grid of C -> C channels (32-512) and 2x2-tile counts (64-4096),
  where the size rule of :func:`lit_amp_det.models.winograd_conv.winograd_pays` comes from (run it with
  ``--repeats 3``: the largest layers take seconds).
* ``winograd_4x4`` (CPU): ``model.winograd_output_tile=4``'s A/B, the ``winograd`` layers by F(4x4, 3x3) tiles
  against F(2x2, 3x3) tiles, in fp32; ``winograd_4x4_sizes`` the same over the ``winograd_sizes`` grid (where
  :data:`lit_amp_det.models.winograd_conv.F4_MIN_TILES` comes from).
* ``winograd_weights`` (CPU): the weight transforms' kernels (``G w G^T`` of every filter, and the weight gradient's
  back transform) against the matrix products they replaced, at the ``winograd`` layers' channel counts, F(2x2) and
  F(4x4), fp32.
* ``model`` (end to end, the ``model.ops`` A/B): the light Mask R-CNN (``conf/model/maskrcnn_light.yaml``,
  224 px, batch 4) built with ``ops=ext`` and ``ops=torchvision`` with identical weights; a bf16-autocast
  training step (forward + backward) and an eval forward. On a GPU, ``maskrcnn_r50_fpn`` at 800 px, batch 2.

Targets (issue 3): every op >= 1.3x, NMS with max_output at RPN sizes >= 2x, MultiScaleRoIAlign
forward+backward >= 1.5x.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import Tensor

import lit_amp_det.ops as ops
from lit_amp_det.bench.common import compose, cpu_name, write_json
from lit_amp_det.profiling import timed

__all__ = ["main"]

IMAGE = (800, 1216)
STRIDES = (4, 8, 16, 32)


def _boxes(n: int, clusters: int, seed: int, max_size: float = 300.0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    size = 4 + torch.rand(n, 2, generator=g) * (max_size - 4)
    centres = torch.rand(clusters, 2, generator=g) * torch.tensor([IMAGE[1], IMAGE[0]])
    centre = centres[torch.randint(clusters, (n,), generator=g)] + torch.randn(n, 2, generator=g) * 0.15 * size
    return torch.cat([centre - size / 2, centre + size / 2], dim=1)


def _scores(n: int, seed: int) -> Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def _rois(k: int, seed: int) -> Tensor:
    boxes = _boxes(k, 30, seed, max_size=600)
    return torch.cat([torch.randint(2, (k, 1), generator=torch.Generator().manual_seed(seed)).float(), boxes], 1)


def _compare(name: str, size: str, dtype: str, ours: Callable[[], Any], theirs: Callable[[], Any], *,
             device: str, repeats: int, warmup: int) -> dict[str, Any]:
    for _ in range(warmup):
        ours(), theirs()
    ours_s, theirs_s = [], []
    for _ in range(repeats):
        ours_s.append(timed(ours, device))
        theirs_s.append(timed(theirs, device))
    mine, tv = statistics.median(ours_s), statistics.median(theirs_s)
    return {"op": name, "size": size, "dtype": dtype, "device": device, "ours_ms": 1000 * mine,
            "torchvision_ms": 1000 * tv, "speedup": tv / mine,
            "ours_spread_ms": 1000 * (max(ours_s) - min(ours_s)), "repeats": repeats}


def _backward(fn: Callable[[], Tensor], inputs: Sequence[Tensor]) -> Callable[[], None]:
    def step() -> None:
        out = fn()
        grads = torch.autograd.grad(out, list(inputs), torch.ones_like(out))
        del grads
    return step


def _nms_cases(device: str) -> list[tuple[str, str, str, Callable, Callable]]:
    rpn_boxes, rpn_scores = _boxes(12000, 300, 0).to(device), _scores(12000, 0).to(device)
    level_boxes = torch.cat([_boxes(2000, 60, seed) for seed in range(5)]).to(device)
    level_scores = _scores(10000, 1).to(device)
    levels = torch.arange(5, device=device).repeat_interleave(2000)
    det_boxes, det_scores = _boxes(5000, 100, 2).to(device), _scores(5000, 2).to(device)
    labels = torch.randint(80, (5000,), generator=torch.Generator().manual_seed(2)).to(device)
    full_boxes, full_scores = _boxes(5000, 100, 3).to(device), _scores(5000, 3).to(device)
    tv = torchvision.ops
    return [
        ("nms rpn (max_output)", "12000 -> 2000, IoU 0.7", "fp32",
         lambda: ops.nms(rpn_boxes, rpn_scores, 0.7, 2000), lambda: tv.nms(rpn_boxes, rpn_scores, 0.7)[:2000]),
        ("batched_nms rpn (max_output)", "5 levels x 2000 -> 2000", "fp32",
         lambda: ops.batched_nms(level_boxes, level_scores, levels, 0.7, 2000),
         lambda: tv.batched_nms(level_boxes, level_scores, levels, 0.7)[:2000]),
        ("batched_nms det (max_output)", "5000 over 80 classes -> 100", "fp32",
         lambda: ops.batched_nms(det_boxes, det_scores, labels, 0.5, 100),
         lambda: tv.batched_nms(det_boxes, det_scores, labels, 0.5)[:100]),
        ("nms full", "5000, IoU 0.5", "fp32",
         lambda: ops.nms(full_boxes, full_scores, 0.5), lambda: tv.nms(full_boxes, full_scores, 0.5)),
    ]


def _iou_cases(device: str) -> list[tuple[str, str, str, Callable, Callable]]:
    gt = _boxes(20, 20, 4).to(device)
    anchors = _boxes(240_000, 1000, 5).to(device)
    proposals = _boxes(2000, 100, 6).to(device)
    return [
        ("box_iou", "20 x 240000 (RPN matcher)", "fp32",
         lambda: ops.box_iou(gt, anchors), lambda: torchvision.ops.box_iou(gt, anchors)),
        ("box_iou", "20 x 2000 (RoI matcher)", "fp32",
         lambda: ops.box_iou(gt, proposals), lambda: torchvision.ops.box_iou(gt, proposals)),
    ]


def _roi_align_cases(device: str, half: torch.dtype) -> list[tuple[str, str, str, Callable, Callable]]:
    cases = []
    base = torch.randn(2, 256, IMAGE[0] // 8, IMAGE[1] // 8, generator=torch.Generator().manual_seed(7)).to(device)
    variants = [("fp32", base, torch.contiguous_format, False),
                ("fp32 channels_last", base, torch.channels_last, False),
                (f"{str(half).split('.')[-1]} (tv: autocast)", base.to(half), torch.contiguous_format, True)]
    for head, k, out in (("box head", 512, 7), ("mask head", 128, 14)):
        rois = _rois(k, 8).to(device)
        for label, features, layout, autocast in variants:
            x = features.contiguous(memory_format=layout).requires_grad_()
            context = (lambda: torch.autocast(device, dtype=half)) if autocast else nullcontext

            def theirs(x=x, rois=rois, out=out, context=context):
                with context():
                    return torchvision.ops.roi_align(x, rois, out, 0.125, 2)

            def ours(x=x, rois=rois, out=out):
                return ops.roi_align(x, rois, out, 0.125, 2)

            size = f"{head}: {k} RoIs {out}x{out}, 2x256x{IMAGE[0] // 8}x{IMAGE[1] // 8}"
            cases.append(("roi_align fwd", size, label, lambda f=ours: f().detach(), lambda f=theirs: f().detach()))
            cases.append(("roi_align fwd+bwd", size, label, _backward(ours, [x]), _backward(theirs, [x])))
    return cases


def _pooler_cases(device: str, half: torch.dtype) -> list[tuple[str, str, str, Callable, Callable]]:
    names = [str(i) for i in range(len(STRIDES))]
    g = torch.Generator().manual_seed(9)
    boxes = [_boxes(512, 40, seed, max_size=700).clamp(min=0).to(device) for seed in (10, 11)]
    shapes = [IMAGE, IMAGE]
    ours_pool = ops.MultiScaleRoIAlign(names, 7, 2)
    tv_pool = torchvision.ops.MultiScaleRoIAlign(names, 7, 2)
    cases = []
    for label, dtype, autocast in (("fp32", torch.float32, False),
                                   (f"{str(half).split('.')[-1]} (tv: autocast)", half, True)):
        features = {n: torch.randn(2, 256, IMAGE[0] // s, IMAGE[1] // s, generator=g).to(device, dtype)
                    .requires_grad_() for n, s in zip(names, STRIDES)}
        context = (lambda: torch.autocast(device, dtype=half)) if autocast else nullcontext

        def theirs(features=features, context=context):
            with context():
                return tv_pool(features, boxes, shapes)

        def ours(features=features):
            return ours_pool(features, boxes, shapes)

        size = "4 levels, 1024 RoIs 7x7, 256 channels"
        cases.append(("MultiScaleRoIAlign fwd", size, label, lambda f=ours: f().detach(), lambda f=theirs: f().detach()))
        cases.append(("MultiScaleRoIAlign fwd+bwd", size, label, _backward(ours, list(features.values())),
                      _backward(theirs, list(features.values()))))
    return cases


#: (name, N, C, H, W) of the 3x3 stride-1 layers ``bench ops --only winograd`` times (C -> C channels)
WINOGRAD_LAYERS = (
    ("R50 mask head, 70 RoIs", 70, 256, 14, 14),
    ("R50 FPN/RPN P2, 256 px b2", 2, 256, 64, 64),
    ("ResNet-18 layer1, 224 px b4", 4, 64, 56, 56),
    ("ResNet-18 layer2, 224 px b4", 4, 128, 28, 28),
    ("ResNet-18 layer3, 224 px b4", 4, 256, 14, 14),
    ("light FPN P2, 224 px b4", 4, 64, 56, 56),
)


def _winograd_grid() -> list[tuple[str, int, int, int, int]]:
    """The ``winograd_sizes`` layers: C -> C channels by 2x2-tile counts (N images of H x H: N * ceil(H / 2)^2
    tiles)."""
    from lit_amp_det.ops.winograd import tile_count

    # 64 (ResNet-18 layer4 at 224 px, batch 4), 64, 128, 196 (its layer3), 256, 784 (its layer2), 4096 tiles
    maps = ((4, 7), (1, 16), (2, 16), (4, 14), (1, 32), (4, 28), (4, 64))
    return [(f"{c} channels, {tile_count(n, h, h)} tiles", n, c, h, h) for c in (32, 64, 128, 256, 512)
            for n, h in maps]


def _winograd_operands(g: torch.Generator, name: str, n: int, c: int, h: int, w: int,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, str]:
    """A C -> C layer's channels_last input and 3x3 weight in ``dtype`` (both requiring grad), and its size label."""
    x = torch.randn(n, c, h, w, generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
    weight = (torch.randn(c, c, 3, 3, generator=g) / (3 * c ** 0.5)).to(dtype)
    return x.requires_grad_(), weight.requires_grad_(), f"{name}: {n}x{c}x{h}x{w}, {c} -> {c}"


def _winograd_cases(device: str, half: torch.dtype,
                    layers: Sequence[tuple[str, int, int, int, int]] | None = None
                    ) -> list[tuple[str, str, str, Callable, Callable]]:
    from lit_amp_det.models.winograd_conv import winograd_conv3x3
    from lit_amp_det.precision.hardware import cpu_computes_bf16_natively

    if device != "cpu":
        print("  winograd: CPU only (on CUDA cuDNN chooses its own algorithms); skipped", flush=True)
        return []
    dtypes = [torch.float32, *([half] if cpu_computes_bf16_natively() else [])]
    g = torch.Generator().manual_seed(12)
    cases = []
    for name, n, c, h, w in WINOGRAD_LAYERS if layers is None else layers:
        for dtype in dtypes:
            x, weight, size = _winograd_operands(g, name, n, c, h, w, dtype)
            label = f"{str(dtype).split('.')[-1]} channels_last (vs F.conv2d)"
            cases.append(("winograd conv3x3 fwd+bwd", size, label,
                          _backward(lambda x=x, weight=weight: winograd_conv3x3(x, weight), [x, weight]),
                          _backward(lambda x=x, weight=weight: torch.nn.functional.conv2d(x, weight, padding=1),
                                    [x, weight])))
    return cases


def _winograd_4x4_cases(device: str, layers: Sequence[tuple[str, int, int, int, int]] | None = None
                        ) -> list[tuple[str, str, str, Callable, Callable]]:
    """``model.winograd_output_tile=4``'s A/B: each :data:`WINOGRAD_LAYERS` layer (or each of ``layers``) by F(4x4,
    3x3) tiles against F(2x2, 3x3) tiles, float32 (the dtype F(4x4) is taken in), forward + backward."""
    from lit_amp_det.models.winograd_conv import winograd_conv3x3

    if device != "cpu":
        print("  winograd_4x4: CPU only; skipped", flush=True)
        return []
    g = torch.Generator().manual_seed(12)
    cases = []
    for name, n, c, h, w in WINOGRAD_LAYERS if layers is None else layers:
        x, weight, size = _winograd_operands(g, name, n, c, h, w, torch.float32)
        cases.append(("winograd conv3x3 fwd+bwd", size, "float32 channels_last, F(4x4) vs F(2x2)",
                      _backward(lambda x=x, weight=weight: winograd_conv3x3(x, weight, None, 4), [x, weight]),
                      _backward(lambda x=x, weight=weight: winograd_conv3x3(x, weight, None, 2), [x, weight])))
    return cases


def _winograd_weight_cases(device: str) -> list[tuple[str, str, str, Callable, Callable]]:
    """The weight transforms' kernels against the matrix-product form they replaced (``[alpha^2, 9] @ [9, C_out *
    C_in]`` for the tiles, used through a transposed view; ``[9, alpha^2] @ [alpha^2, C_out * C_in]`` and a copy into
    the weight's layout for the gradient), per channel count of :data:`WINOGRAD_LAYERS`, F(2x2) and F(4x4), fp32,
    channels_last weights (the model's with ``model.channels_last=true``)."""
    from lit_amp_det.ops.reference import _WINOGRAD_G, _WINOGRAD_GRAD_AT
    from lit_amp_det.ops.winograd import POSITIONS, winograd_weight_gradient, winograd_weight_tiles

    if device != "cpu":
        print("  winograd_weights: CPU only; skipped", flush=True)
        return []

    def matmul_tiles(weight: Tensor, kron: Tensor) -> Tensor:
        c_out, c_in = weight.shape[:2]
        return torch.mm(kron, weight.reshape(c_out * c_in, 9).t()).view(-1, c_out, c_in).transpose(1, 2)

    def matmul_gradient(products: Tensor, kron: Tensor, like: Tensor) -> Tensor:
        positions, c_out, c_in = products.shape
        grad = torch.mm(kron, products.reshape(positions, c_out * c_in))
        return torch.empty_like(like).copy_(grad.t().reshape(c_out, c_in, 3, 3))

    g = torch.Generator().manual_seed(12)
    cases = []
    for c in sorted({layer[2] for layer in WINOGRAD_LAYERS}):
        weight = torch.randn(c, c, 3, 3, generator=g).contiguous(memory_format=torch.channels_last)
        for side in (2, 4):
            tiles_kron = torch.kron(*[torch.tensor(_WINOGRAD_G[side], dtype=torch.float32)] * 2)
            back_kron = torch.kron(*[torch.tensor(_WINOGRAD_GRAD_AT[side], dtype=torch.float32)] * 2)
            products = torch.randn(POSITIONS[side], c, c, generator=g)
            size, label = f"{c} -> {c} channels, F({side}x{side})", "float32 channels_last weight (vs matmul)"
            cases.append(("winograd weight tiles", size, label,
                          lambda w=weight, s=side: winograd_weight_tiles(w, output_tile=s),
                          lambda w=weight, k=tiles_kron: matmul_tiles(w, k)))
            cases.append(("winograd weight gradient", size, label,
                          lambda p=products, w=weight: winograd_weight_gradient(p, w),
                          lambda p=products, k=back_kron, w=weight: matmul_gradient(p, k, w)))
    return cases


def _model_cases(device: str, half: torch.dtype) -> list[tuple[str, str, str, Callable, Callable]]:
    from lit_amp_det.models.maskrcnn import build_detector

    name, batch, side = ("maskrcnn_r50_fpn", 2, 800) if device == "cuda" else ("maskrcnn_light", 4, 224)
    cfg = compose([f"model={name}"])
    settings = {k: cfg.model[k] for k in ("backbone", "transform", "rpn", "roi_heads")}
    torch.manual_seed(0)
    ext = build_detector(7, ops="ext", **settings).to(device)
    plain = build_detector(7, ops="torchvision", **settings).to(device)
    plain.load_state_dict(ext.state_dict())
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, side, side, generator=g).to(device) for _ in range(batch)]
    targets = []
    for _ in range(batch):
        xy = torch.rand(3, 2, generator=g) * side * 0.6
        boxes = torch.cat([xy, xy + side * (0.15 + 0.25 * torch.rand(3, 2, generator=g))], 1)
        masks = torch.zeros(3, side, side, dtype=torch.uint8)
        for k, (x0, y0, x1, y1) in enumerate(boxes.int().tolist()):
            masks[k, y0:y1, x0:x1] = 1
        targets.append({"boxes": boxes.to(device), "labels": torch.tensor([1, 2, 3], device=device),
                        "masks": masks.to(device)})

    def train_step(model):
        model.train()
        with torch.autocast(device, dtype=half):
            losses = model(images, targets)
        sum(losses.values()).backward()

    def infer(model):
        model.eval()
        with torch.no_grad(), torch.autocast(device, dtype=half):
            model(images)

    size = f"{name}, batch {batch}, {side} px, {str(half).split('.')[-1]} autocast"
    return [("Mask R-CNN train step (model.ops)", size, "ext vs torchvision",
             lambda: train_step(ext), lambda: train_step(plain)),
            ("Mask R-CNN inference (model.ops)", size, "ext vs torchvision", lambda: infer(ext), lambda: infer(plain))]


def _table(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "| op | size | dtype / layout | ours ms | torchvision ms (torch's for winograd) | speed-up |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['size']} | {r['dtype']} | {r['ours_ms']:.2f} | {r['torchvision_ms']:.2f} "
                     f"| **{r['speedup']:.2f}x** |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_amp_det bench ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per op (default 15 CPU, 50 CUDA)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--only", default="",
                        help="comma-separated groups: nms,iou,roi_align,pooler,winograd,winograd_sizes,winograd_4x4,"
                             "winograd_4x4_sizes,winograd_weights,model (default all but the two _sizes grids)")
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if not ops.extension_available():
        raise SystemExit(f"bench ops compares the compiled kernels, but lit_amp_det._C is not built "
                         f"({ops.extension_error()}). Run `make install` first.")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device=cuda but torch sees no GPU; use --device=cpu")
    repeats = args.repeats or (50 if args.device == "cuda" else 15)
    half = torch.float16 if args.device == "cuda" else torch.bfloat16
    groups = {"nms": lambda: _nms_cases(args.device), "iou": lambda: _iou_cases(args.device),
              "roi_align": lambda: _roi_align_cases(args.device, half),
              "pooler": lambda: _pooler_cases(args.device, half),
              "winograd": lambda: _winograd_cases(args.device, half),
              "winograd_sizes": lambda: _winograd_cases(args.device, half, _winograd_grid()),
              "winograd_4x4": lambda: _winograd_4x4_cases(args.device),
              "winograd_4x4_sizes": lambda: _winograd_4x4_cases(args.device, _winograd_grid()),
              "winograd_weights": lambda: _winograd_weight_cases(args.device),
              "model": lambda: _model_cases(args.device, half)}
    chosen = [g.strip() for g in args.only.split(",") if g.strip()] or [g for g in groups if not g.endswith("_sizes")]
    unknown = sorted(set(chosen) - set(groups))
    if unknown:
        raise SystemExit(f"--only: unknown group(s) {unknown}; choose from {sorted(groups)}")
    torch.manual_seed(0)
    rows = []
    for group in chosen:
        for name, size, dtype, ours, theirs in groups[group]():
            rows.append(_compare(name, size, dtype, ours, theirs, device=args.device, repeats=repeats,
                                 warmup=args.warmup))
            print(f"  {name} [{size}, {dtype}]: {rows[-1]['speedup']:.2f}x", flush=True)
    device_name = (torch.cuda.get_device_name() if args.device == "cuda"
                   else f"{cpu_name()}, {torch.get_num_threads()} threads")
    header = (f"device={args.device} ({device_name}) torch={torch.__version__} torchvision={torchvision.__version__} "
              f"repeats={repeats} (median; warm-up {args.warmup} excluded)")
    print(_table(rows, header))
    write_json(args.json, {"header": header, "rows": rows})


if __name__ == "__main__":
    main()

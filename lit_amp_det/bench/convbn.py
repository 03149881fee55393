"""``python -m lit_amp_det bench convbn``: what tune-mode conv-BN (the ``ConvBNEval`` callback) saves, side by
side.

Every BatchNorm is in eval mode (``norm_eval``; FrozenBatchNorm2d where a case says so). Each case runs the
same weights and batch side by side in this one process: ``plain``, then with ``enable_conv_bn_eval``
(``only_when_cheaper`` on; for ResNet-50 also off). Columns, with ratios to the case's ``plain`` row:

* saved MB: bytes autograd keeps for backward, device independent (distinct storages packed by
  ``saved_tensors_hooks`` during the forward, parameters and buffers excluded), for the backbone (the ResNet;
  ``model.backbone``, i.e. trunk + FPN, for detectors) and for the whole model;
* peak MB: one forward + backward above what was held before it (CUDA: ``max_memory_allocated``; CPU: the
  resident-set high-water mark ``VmHWM``, with glibc's mmap threshold pinned so that freed tensors leave the
  resident set);
* step ms: forward + backward, median of the timed repeats after warm-up, variants interleaved per repeat.

Cases (``--cases``): ResNet-50 at 2x3x512x512 and 4x3x128x128 (where the folded weight copies outweigh the
small late-stage activations), Mask R-CNN R50-FPN (``conf/model/maskrcnn_r50_fpn.yaml``; 2 images, 512 px on a
CPU, 800 x 1333 on CUDA) with BatchNorm in eval mode and with its FrozenBatchNorm2d, and the light model
(ResNet-18, 224 px, batch 4). Target: >= 25 % fewer saved bytes in the backbone under norm_eval with no
slowdown.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torchvision
from hydra.utils import instantiate
from torch import Tensor, nn

from lit_amp_det.bench.rows import compose
from lit_amp_det.models.conv_bn import NORM_TYPES, enable_conv_bn_eval
from lit_amp_det.profiling import MB, MemoryProbe, SavedTensorBytes, pin_malloc_threshold, timed

__all__ = ["CASES", "main"]

Batch = Any
LossFn = Callable[[nn.Module, Batch], Tensor]


@dataclass
class Case:
    """One model and input; ``variants`` are ``(label, only_when_cheaper or None for plain)``."""

    name: str
    input: str
    build: Callable[
        [str], tuple[nn.Module, nn.Module, Batch, LossFn]
    ]  # device -> model, backbone, batch, loss
    variants: tuple[tuple[str, bool | None], ...] = (("plain", None), ("ConvBNEval", True))


def _norm_eval(model: nn.Module) -> nn.Module:
    model.train()
    for module in model.modules():
        if isinstance(module, (nn.BatchNorm2d, nn.SyncBatchNorm)):
            module.eval()
    return model


def _resnet50(batch: int, size: int, device: str) -> tuple[nn.Module, nn.Module, Batch, LossFn]:
    torch.manual_seed(0)
    model = _norm_eval(torchvision.models.resnet50().to(device))
    images = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0)).to(device)
    return model, model, images, lambda m, x: m(x).float().logsumexp(dim=1).mean()


def _detection_batch(batch: int, height: int, width: int, device: str) -> Batch:
    """``batch`` seeded float images in [0, 1) with 3 boxes, labels 1-3 and box-shaped masks each."""
    gen = torch.Generator().manual_seed(0)
    images, targets = [], []
    for _ in range(batch):
        images.append(torch.rand(3, height, width, generator=gen).to(device))
        xy = torch.rand(3, 2, generator=gen) * torch.tensor([width, height]) * 0.6
        size = (0.15 + 0.25 * torch.rand(3, 2, generator=gen)) * torch.tensor([width, height])
        boxes = torch.cat([xy, xy + size], 1)
        masks = torch.zeros(3, height, width, dtype=torch.uint8)
        for k, (x0, y0, x1, y1) in enumerate(boxes.int().tolist()):
            masks[k, y0:y1, x0:x1] = 1
        targets.append(
            {
                "boxes": boxes.to(device),
                "labels": torch.tensor([1, 2, 3], device=device),
                "masks": masks.to(device),
            }
        )
    return images, targets


def _detection_loss(model: nn.Module, batch: Batch) -> Tensor:
    torch.manual_seed(0)  # the RPN and RoI samplers draw from the global RNG: same samples for every variant
    return torch.stack([v.float() for v in model(*batch).values()]).sum()


def _detector(
    config: str,
    batch: int,
    overrides: Sequence[str],
    cpu_size: tuple[int, int],
    cuda_size: tuple[int, int],
    device: str,
) -> tuple[nn.Module, nn.Module, Batch, LossFn]:
    height, width = cuda_size if device == "cuda" else cpu_size
    cfg = compose(
        [
            f"model={config}",
            "paths.output_dir=/tmp",
            "paths.cache_dir=/tmp",
            f"model.transform.min_size={min(height, width)}",
            f"model.transform.max_size={max(height, width)}",
            *overrides,
        ]
    )
    torch.manual_seed(0)
    model = _norm_eval(instantiate(cfg.model, _convert_="all", num_classes=4).model.to(device))
    return model, model.backbone, _detection_batch(batch, height, width, device), _detection_loss


_BOTH = (("plain", None), ("ConvBNEval", True), ("ConvBNEval all", False))

#: name -> case; ``--cases`` picks a subset.
CASES: dict[str, Case] = {
    "r50-512": Case("ResNet-50", "2x3x512x512", partial(_resnet50, 2, 512), _BOTH),
    "r50-128": Case("ResNet-50", "4x3x128x128", partial(_resnet50, 4, 128), _BOTH),
    "maskrcnn-r50": Case(
        "Mask R-CNN R50-FPN, BN eval",
        "2 images, 512 px (CPU) / 800x1333 (CUDA)",
        partial(_detector, "maskrcnn_r50_fpn", 2, ["model.backbone.norm=bn"], (512, 512), (800, 1333)),
    ),
    "maskrcnn-r50-frozen": Case(
        "Mask R-CNN R50-FPN, FrozenBN",
        "2 images, 512 px (CPU) / 800x1333 (CUDA)",
        partial(_detector, "maskrcnn_r50_fpn", 2, [], (512, 512), (800, 1333)),
        _BOTH,
    ),
    "maskrcnn-light": Case(
        "Mask R-CNN light (R18-FPN), BN eval",
        "4 images, 224 px",
        partial(_detector, "maskrcnn_light", 4, [], (224, 224), (224, 224)),
    ),
}


class _Peak:
    """Peak memory of a block above what was held when it started, in MB (a :class:`MemoryProbe` window); on a
    CPU with glibc's mmap threshold pinned first, so that freed tensors leave the resident set.
    """

    def __init__(self, device: str) -> None:
        if device != "cuda":
            pin_malloc_threshold()
        self.probe = MemoryProbe(device)
        self.method = (
            "max_memory_allocated"
            if self.probe.cuda
            else "VmHWM (clear_refs)"
            if self.probe.resettable
            else "ru_maxrss (not resettable: later rows only show growth past earlier peaks)"
        )

    @contextmanager
    def measure(self) -> Iterator[dict[str, float]]:
        result: dict[str, float] = {}
        if not self.probe.cuda:
            pin_malloc_threshold()
        self.probe.synchronize()
        self.probe.reset_peak()
        base = self.probe.baseline_bytes()
        yield result
        self.probe.synchronize()
        result["peak_mb"] = (self.probe.peak_bytes() - base) / MB


def _count_folds(model: nn.Module) -> tuple[list[Any], list[int]]:
    """Forward hooks counting norm calls that passed the folded conv output through unchanged."""
    count = [0]

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        count[0] += int(output is args[0])

    return [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, NORM_TYPES)], count


def run_case(
    case: Case, *, device: str, warmup: int, repeats: int, autocast: torch.dtype | None
) -> list[dict[str, Any]]:
    """Measures every variant of ``case``; returns one row per variant."""
    model, backbone, batch, loss_fn = case.build(device)
    path = {id(m): name for name, m in model.named_modules()}[id(backbone)]
    norm = next(
        f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules() if isinstance(m, NORM_TYPES)
    )
    variants = []
    for label, cheaper in case.variants:
        clone = copy.deepcopy(model)
        pairs = [] if cheaper is None else enable_conv_bn_eval(clone, only_when_cheaper=cheaper)
        variants.append(
            {"label": label, "model": clone, "backbone": clone.get_submodule(path), "pairs": pairs}
        )
    context = (lambda: torch.autocast(device, dtype=autocast)) if autocast is not None else nullcontext
    peak = _Peak(device)

    def step(v: dict[str, Any]) -> Tensor:
        with context():
            return loss_fn(v["model"], batch)

    rows = []
    for v in variants:
        for _ in range(warmup):
            step(v).backward()
            v["model"].zero_grad(set_to_none=True)
        handles, folds = _count_folds(v["model"])
        with peak.measure() as memory:
            state = [*v["model"].parameters(), *v["model"].buffers()]
            with SavedTensorBytes(exclude=state, within=v["backbone"]) as saved:
                loss = step(v)
            loss.backward()
            v["model"].zero_grad(set_to_none=True)
            del loss
        for handle in handles:
            handle.remove()
        rows.append(
            {
                "case": case.name,
                "input": case.input,
                "norm": norm,
                "variant": v["label"],
                "pairs": len(v["pairs"]),
                "folded_calls": folds[0],
                "saved_backbone_mb": saved.within_bytes / MB,
                "saved_total_mb": saved.bytes / MB,
                "peak_mb": memory["peak_mb"],
                "times": [],
            }
        )
    for _ in range(repeats):
        for v, row in zip(variants, rows):
            row["times"].append(timed(lambda v=v: step(v).backward(), device))
            v["model"].zero_grad(set_to_none=True)
    for row in rows:
        row["step_ms"] = 1000 * statistics.median(row.pop("times"))
    return rows


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 else "-"


def table(rows: list[dict[str, Any]], header: str) -> str:
    """Markdown table; ratios against the ``plain`` row of the same case and input."""
    lines = [
        header,
        "| model | input | variant | pairs (folded calls) | saved backbone MB | vs plain | saved total MB "
        "| vs plain | peak MB | vs plain | step ms | vs plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next(
            b for b in rows if b["case"] == r["case"] and b["input"] == r["input"] and b["variant"] == "plain"
        )
        cells = [
            f"{r[key]:{spec}} | {_ratio(r[key], base[key])}"
            for key, spec in (
                ("saved_backbone_mb", ".1f"),
                ("saved_total_mb", ".1f"),
                ("peak_mb", ".0f"),
                ("step_ms", ".0f"),
            )
        ]
        lines.append(
            f"| {r['case']} | {r['input']} | {r['variant']} | {r['pairs']} ({r['folded_calls']}) | "
            + " | ".join(cells)
            + " |"
        )
    norms = {r["case"]: r["norm"] for r in rows}
    lines += ["", "norm layers: " + "; ".join(f"{case}: `{norm}`" for case, norm in norms.items())]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lit_amp_det bench convbn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    parser.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per variant (median reported)")
    parser.add_argument(
        "--precision",
        default="32",
        choices=["32", "bf16-mixed", "16-mixed"],
        help="32: fp32; *-mixed: the step runs under torch.autocast with that dtype",
    )
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.cases.split(",")) - set(CASES)):
        parser.error(f"--cases: unknown {unknown}; choose from {', '.join(CASES)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    autocast = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}[args.precision]
    rows = []
    for name in args.cases.split(","):
        rows += run_case(
            CASES[name], device=args.device, warmup=args.warmup, repeats=args.repeats, autocast=autocast
        )
    header = (
        f"device={args.device} precision={args.precision} threads={torch.get_num_threads()} "
        f"warm-up={args.warmup} repeats={args.repeats} (median) peak={_Peak(args.device).method} "
        f"torch={torch.__version__}"
    )
    print(table(rows, header))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

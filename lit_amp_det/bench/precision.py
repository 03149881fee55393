"""``python -m lit_amp_det bench precision``: train-step throughput and peak memory per precision setting.

Rows: ``32-true``, ``bf16-mixed`` and ``16-mixed`` each with the default fp32 regions and with plain
autocast (no regions), so the table shows both what mixed precision buys and what the fp32 regions cost.
Every row runs in its own process (peak memory of a process only grows), on the same synthetic batches,
with warm-up steps excluded and the median of the timed steps reported; ratios are to the ``32-true`` row
of the same run. Memory is the peak above what the process held after building the model (CPU: peak
resident set; CUDA: allocator peak). ``16-mixed`` rows run only on CUDA unless ``--fp16-on-cpu`` is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import torch

from lit_amp_det.bench.common import compose, train_step, write_json
from lit_amp_det.profiling import MB, MemoryProbe, StepTimer

__all__ = ["main", "run_row"]

ROWS = [
    ("32-true", "regions"),
    ("bf16-mixed", "regions"),
    ("bf16-mixed", "plain"),
    ("16-mixed", "regions"),
    ("16-mixed", "plain"),
]


def _batch(batch: int, size: int, device: str) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    images, targets = [], []
    for _ in range(batch):
        images.append(torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=gen).to(device))
        boxes, masks = [], torch.zeros(3, size, size, dtype=torch.uint8)
        for k in range(3):
            x0, y0 = (torch.rand(2, generator=gen) * size * 0.6).tolist()
            w, h = (size * (0.15 + 0.25 * torch.rand(2, generator=gen))).tolist()
            boxes.append([x0, y0, x0 + w, y0 + h])
            masks[k, int(y0) : int(y0 + h), int(x0) : int(x0 + w)] = 1
        targets.append({"boxes": torch.tensor(boxes, device=device), "labels": torch.tensor([1, 2, 3], device=device),
                        "masks": masks.to(device)})
    return images, targets


def run_row(precision: str, regions: str, *, model: str, batch: int, size: int, steps: int, warmup: int,
            device: str, fp16_on_cpu: bool) -> dict[str, Any]:
    """Times ``steps`` training steps of one configuration in this process."""
    from hydra.utils import instantiate

    from lit_amp_det.precision import build_precision_plugin

    # never reset: its peak is the process's since here, the building of the model included
    probe = MemoryProbe(device)
    cfg = compose([f"model={model}", "paths.output_dir=/tmp", "paths.cache_dir=/tmp"])
    torch.manual_seed(0)
    module = instantiate(cfg.model, _convert_="all", num_classes=4).to(device)
    plugin = build_precision_plugin(precision, "gpu" if device == "cuda" else "cpu", fp16_on_cpu=fp16_on_cpu,
                                    fp32_regions=None if regions == "regions" else {})
    plugin.convert_module(module)
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0.9)
    images, targets = _batch(batch, size, device)
    module.train()
    base_memory = probe.peak_bytes() / MB
    timer = StepTimer(device, warmup)
    times = []
    for _ in range(warmup + steps):
        timer.start()
        loss = train_step(module, plugin, optimizer, images, targets)
        seconds = timer.stop()
        if seconds is not None:
            times.append(seconds)
    return {
        "precision": getattr(plugin, "precision", precision),
        "fp32_regions": regions,
        "step_ms_median": 1000 * statistics.median(times),
        "step_ms_spread": 1000 * (max(times) - min(times)),
        "images_per_s": batch / statistics.median(times),
        "peak_memory_mb": probe.peak_bytes() / MB,
        "peak_memory_growth_mb": probe.peak_bytes() / MB - base_memory,
        "final_loss": float(loss),
    }


def _table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    base = next(r for r in rows if r["precision"] == "32-true")
    lines = [
        f"device={args.device} model={args.model} batch={args.batch} image={args.size}x{args.size} "
        f"steps={args.steps} (warm-up {args.warmup} excluded) torch={torch.__version__}",
        "| precision | fp32 regions | step ms (median) | spread ms | images/s | speed vs 32-true "
        "| training peak MB | peak vs 32-true |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['precision']} | {'-' if r['precision'] == '32-true' else r['fp32_regions']} | "
            f"{r['step_ms_median']:.0f} | {r['step_ms_spread']:.0f} | "
            f"{r['images_per_s']:.2f} | {base['step_ms_median'] / r['step_ms_median']:.2f}x | "
            f"{r['peak_memory_growth_mb']:.0f} | {r['peak_memory_growth_mb'] / base['peak_memory_growth_mb']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_amp_det bench precision", description=__doc__)
    parser.add_argument("--model", default="maskrcnn_light", help="model config (conf/model/*.yaml)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=224, help="square image side in pixels")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--fp16-on-cpu", action="store_true", help="also time 16-mixed on a CPU")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row and print its JSON
    args = parser.parse_args(argv)
    if args.row:
        precision, regions = args.row.split(":")
        row = run_row(precision, regions, model=args.model, batch=args.batch, size=args.size, steps=args.steps,
                      warmup=args.warmup, device=args.device, fp16_on_cpu=args.fp16_on_cpu)
        print(json.dumps(row))
        return
    rows = []
    for precision, regions in ROWS:
        if precision == "16-mixed" and args.device == "cpu" and not args.fp16_on_cpu:
            continue
        command = [sys.executable, "-m", "lit_amp_det.bench.precision", f"--row={precision}:{regions}",
                   f"--model={args.model}", f"--batch={args.batch}", f"--size={args.size}", f"--steps={args.steps}",
                   f"--warmup={args.warmup}", f"--device={args.device}", *(["--fp16-on-cpu"] if args.fp16_on_cpu else [])]
        out = subprocess.run(command, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"bench row {precision}/{regions} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(_table(rows, args))
    write_json(args.json, {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

"""``python -m lit_amp_det.bench.coco_eval``: COCO mAP with faster-coco-eval against pycocotools, same
predictions.

``model.evaluation.backend`` picks the library behind ``MaskRCNNModule``'s ``MeanAveragePrecision``
(:data:`lit_amp_det.module_settings.EVAL_BACKENDS`). This bench measures what the switch changes, on the split
``validate`` scores (by default the embedded shapes validation split, 100 images of 160 px, masks and boxes):

1. predictions: the model (``--checkpoint``, else random weights) runs once over the split, in fp32 under
   ``torch.inference_mode()``; predictions and targets are what ``MaskRCNNModule.validation_step`` gives its
   metric (boolean masks at image size, targets with ``iscrowd`` and ``area``);
2. metric: per backend, a fresh metric from ``MaskRCNNModule.build_metric`` gets ``update()`` with every
   batch, then ``compute()``; backends interleaved per repeat after ``--warmup`` untimed rounds; median and
   IQR of update, compute and their sum;
3. agreement: every key of ``compute()`` (bbox and segm mAP and mAR at each threshold and size, per class)
   compared; the largest absolute difference per key and whether all are within ``--atol``.

Exits with status 1 when the backends disagree beyond ``--atol`` (the table is printed first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lit_amp_det.bench.measure import summarise
from lit_amp_det.bench.rows import compose
from lit_amp_det.module_settings import EVAL_BACKENDS, check_eval_backend

__all__ = ["collect", "compare", "main", "time_metric"]

Pairs = list[tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]]  # (predictions, targets) per batch


def collect(checkpoint: str | None, overrides: Sequence[str]) -> tuple[Any, Pairs]:
    """The module (with ``checkpoint``'s weights) and its (predictions, targets) for every validation
    batch.
    """
    from lit_amp_det.app.tasks import build_datamodule, build_model

    weights = [f"model.weights={checkpoint}"] if checkpoint else []
    cfg = compose(["command=validate", "paths.output_dir=/tmp", *weights, *overrides])
    datamodule = build_datamodule(cfg)
    datamodule.setup("validate")
    module = build_model(cfg, datamodule).eval()
    with torch.inference_mode():
        return module, [
            (module(images), [module._metric_target(t) for t in targets])
            for images, targets in datamodule.val_dataloader()
        ]


def _score(module: Any, backend: str, pairs: Pairs) -> tuple[float, float, dict[str, Tensor]]:
    """Scores ``pairs`` with a fresh metric of ``backend``: seconds of ``update()`` over every batch, seconds
    of ``compute()``, and ``compute()``'s dict.

    A fresh metric per call, so that no round's ``update()`` inherits the states of the round before it.
    """
    module.evaluation_settings = dataclasses.replace(module.evaluation_settings, backend=backend)
    metric = module.build_metric()
    start = time.perf_counter()
    for predictions, targets in pairs:
        metric.update(predictions, targets)
    updated = time.perf_counter()
    results = metric.compute()
    return updated - start, time.perf_counter() - updated, results


def time_metric(
    module: Any, pairs: Pairs, backends: Sequence[str], warmup: int, repeats: int
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Tensor]]]:
    """Per backend: update/compute/total time statistics (ms) and the last ``compute()`` dict."""
    times: dict[str, dict[str, list[float]]] = {
        b: {"update": [], "compute": [], "total": []} for b in backends
    }
    results: dict[str, dict[str, Tensor]] = {}
    for round_ in range(warmup + repeats):
        for backend in backends:  # interleaved: load drift on a shared machine hits both alike
            update_s, compute_s, results[backend] = _score(module, backend, pairs)
            if round_ >= warmup:
                for key, value in (
                    ("update", update_s),
                    ("compute", compute_s),
                    ("total", update_s + compute_s),
                ):
                    times[backend][key].append(value)
    stats = {
        b: {k: v for part, seconds in t.items() for k, v in summarise(seconds, part).items()}
        for b, t in times.items()
    }
    return stats, results


def compare(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """Largest absolute difference per key of two metric dicts (tensors/floats); ``inf`` where shapes or keys
    differ.
    """
    diffs = {}
    for key in sorted(set(reference) | set(other)):
        a, b = (torch.as_tensor(d[key]).double() if key in d else None for d in (reference, other))
        if a is None or b is None or a.shape != b.shape:
            diffs[key] = float("inf")
        elif a.numel() == 0:
            diffs[key] = 0.0
        else:
            diffs[key] = float((a - b).abs().max())
    return diffs


def _ms(stats: dict[str, Any], part: str) -> str:
    """Median (interquartile range) of the ``part`` times in ms; the range is 0 for a single time."""
    ms = stats[f"{part}_ms_all"]
    q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else (0.0, 0.0, 0.0)
    return f"{stats[f'{part}_ms_median']:.0f} ({q3 - q1:.0f})"


def metric_table(stats: dict[str, dict[str, Any]], base: str) -> str:
    """Markdown: update, compute and total ms (median, IQR) per backend, speed-up of the total against
    ``base``.
    """
    lines = ["| backend | update ms | compute ms | update + compute ms | speed-up |", "|---|---|---|---|---|"]
    lines += [
        f"| {backend} | {_ms(s, 'update')} | {_ms(s, 'compute')} | {_ms(s, 'total')} | "
        f"{stats[base]['total_ms_median'] / s['total_ms_median']:.2f}x |"
        for backend, s in stats.items()
    ]
    return "\n".join(lines)


def agreement_text(diffs: dict[str, float], atol: float, what: str) -> str:
    """One line: the worst key and whether every key is within ``atol``; the keys beyond it, if any."""
    worst = max(diffs, key=diffs.get)
    bad = {k: v for k, v in diffs.items() if v > atol}
    verdict = "all within" if not bad else f"{len(bad)} beyond"
    text = f"{what}: {len(diffs)} keys, {verdict} {atol:g} (largest |diff| {diffs[worst]:.2e} at `{worst}`)"
    return text + "".join(f"\n  - `{k}`: |diff| {v:.2e}" for k, v in bad.items())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lit_amp_det.bench.coco_eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint",
        help="weights to score (a .ckpt or state dict; model.weights=). Default: "
        "random weights, whose few low-score detections make a light load",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed metric rounds per backend")
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed metric rounds per backend (median reported)"
    )
    parser.add_argument(
        "--atol", type=float, default=1e-4, help="largest absolute difference allowed per metric"
    )
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides of the split and model, e.g. data.val_size=500"
    )
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be at least 1, --warmup at least 0")
    if args.checkpoint and not Path(args.checkpoint).is_file():
        parser.error(f"--checkpoint {args.checkpoint}: no such file")
    backends = list(EVAL_BACKENDS)
    for backend in backends:
        check_eval_backend(backend)
    base = "pycocotools"
    module, pairs = collect(args.checkpoint, args.overrides)
    images = sum(len(t) for _, t in pairs)
    detections = sum(len(p["boxes"]) for predictions, _ in pairs for p in predictions)
    stats, results = time_metric(module, pairs, backends, args.warmup, args.repeats)
    diffs = {b: compare(results[base], results[b]) for b in backends if b != base}
    header = (
        f"{images} images, {detections} detections, iou_type={module.build_metric().iou_type}, "
        f"weights={args.checkpoint or 'random'}, overrides={args.overrides}; "
        f"threads={torch.get_num_threads()}, "
        f"warm-up={args.warmup}, repeats={args.repeats} (median, IQR), torch {torch.__version__}, "
        + ", ".join(f"{name} {version(name)}" for name in ("torchmetrics", *EVAL_BACKENDS.values()))
    )
    print(header)
    print(metric_table(stats, base))
    headline = [k for k in results[base] if k.split("_", 1)[-1] in ("map", "map_50", "map_75", "mar_100")]
    print(f"\n{base}: " + ", ".join(f"{k} {float(results[base][k]):.4f}" for k in headline))
    for backend, d in diffs.items():
        print(agreement_text(d, args.atol, f"compute() of {backend} vs {base}"))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "header": header,
                    "images": images,
                    "detections": detections,
                    "metric": stats,
                    "results": {b: {k: v.tolist() for k, v in r.items()} for b, r in results.items()},
                    "diffs": diffs,
                },
                indent=2,
            )
        )
    if any(v > args.atol for d in diffs.values() for v in d.values()):
        sys.exit(f"the backends disagree beyond --atol {args.atol:g} (keys listed above)")


if __name__ == "__main__":
    main()

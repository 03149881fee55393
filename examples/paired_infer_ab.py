"""Paired A/B of ``model.winograd_weight_tile_cache`` on inference calls: one ``bench infer`` row's model, its
Winograd layers calling without (A) and with (B) their kept weight tiles, alternately in one process.

A call is what ``bench infer`` times (``MaskRCNNModule.forward`` under ``torch.inference_mode`` inside the precision
plugin's context, the model in eval mode with conv-BN folded as the row says), on the bench's trained state and
batch. The two arms share the model; B's caches are filled in the warm-up and stay valid (the weights do not
change), A's layers run with their caches set aside. A call's time drifts between processes by more than this
saves, so the arms alternate, A B / B A, and the paired differences are reported: at ``--batch`` (throughput),
then at batch 1 (latency; a layer's tiles are kept per tile size, so some layers make them again there).

    python examples/paired_infer_ab.py --row winograd-4x4 --pairs 60
    python examples/paired_infer_ab.py --row winograd-4x4 --model maskrcnn_r50_fpn --size 256 --batch 2 --pairs 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lit_amp_det.bench import e2e, e2e_rows, infer
from lit_amp_det.bench.common import compose
from lit_amp_det.models.winograd_conv import WeightTileCache, WinogradConv2d


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", default="winograd-4x4", help="a bench infer row with Winograd layers")
    parser.add_argument("--model", default="maskrcnn_light")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=60)
    args = parser.parse_args()
    rows = [row.name for row in infer.ROWS]
    if args.row not in rows:
        parser.error(f"no bench infer row {args.row!r}; choose from {', '.join(rows)}")
    setting = e2e_rows.Setting(device="cpu", model=args.model, batch=args.batch, height=args.size, width=args.size,
                               num_classes=e2e_rows.default_num_classes(args.model), steps=1, warmup=0,
                               compile_warmup=0, state="trained", state_steps=e2e.DEFAULT_STATE_STEPS, half="fp32")
    setting, _ = e2e.prepare(setting, argparse.Namespace(cache_dir=None, peak_seconds=0.5), ["fp32"])
    cfg = compose(e2e_rows.row_overrides(infer.ROWS, rows.index(args.row), setting))
    built = e2e_rows.build(cfg, "cpu", "predict")
    module, plugin = built.module, built.plugin
    module.eval()
    for callback in built.callbacks:
        callback.on_predict_start(None, module)
    layers = [m for m in module.modules() if isinstance(m, WinogradConv2d)]
    if not layers:
        raise SystemExit(f"row {args.row!r} has no Winograd layers")
    caches = [WeightTileCache() for _ in layers]
    images, _ = e2e_rows.synthetic_batch(setting, setting.batch)

    def call(arm: str, batch: list[torch.Tensor]) -> float:
        for layer, cache in zip(layers, caches):
            layer.weight_tile_cache = cache if arm == "B" else None
        start = time.perf_counter()
        with torch.inference_mode(), plugin.forward_context():
            module(batch)
        return 1000 * (time.perf_counter() - start)

    for batch in (images, images[:1]):  # as bench infer: throughput at --batch, latency at batch 1
        for arm in "ABAB":  # warm-up; B fills its caches
            call(arm, batch)
        kept_mb = sum(cache.nbytes for cache in caches) / 2**20
        times: dict[str, list[float]] = {"A": [], "B": []}
        for i in range(args.pairs):
            for arm in ("AB" if i % 2 == 0 else "BA"):
                times[arm].append(call(arm, batch))
        diffs = [a - b for a, b in zip(times["A"], times["B"])]
        ratios = sorted(a / b for a, b in zip(times["A"], times["B"]))
        quartiles, ratio_quartiles = statistics.quantiles(diffs, n=4), statistics.quantiles(ratios, n=4)
        a, b = statistics.median(times["A"]), statistics.median(times["B"])
        print(f"weight-tile cache, {args.row}, {args.model} {args.size} px b{len(batch)}: {len(layers)} Winograd "
              f"layers, {kept_mb:.1f} MB of kept tiles; A {a:.1f} ms, B {b:.1f} ms, {a / b:.3f}x; paired A - B median "
              f"{statistics.median(diffs):.1f} ms (quartiles {quartiles[0]:.1f}, {quartiles[2]:.1f}), paired A / B "
              f"median {statistics.median(ratios):.3f}x (quartiles {ratio_quartiles[0]:.3f}, "
              f"{ratio_quartiles[2]:.3f}), B faster in {sum(d > 0 for d in diffs)}/{args.pairs} pairs", flush=True)

if __name__ == "__main__":
    main()

"""A/B of ``model.binary_mask_paste``: torchvision's mask paste (A: a float image-size canvas per detection, stacked,
then thresholded) against the boolean box-by-box paste (B, :mod:`lit_amp_det.models.mask_paste`), on the bench's
trained light model.

Both arms share one model (a ``bench infer`` row without the switch, the bench's trained state, 224 px inside the
model); only ``module.model.transform`` differs. The paste works at the pictures' own size, so the pictures are
larger than the model's input, as photos are:

1. time, paired in one process: ``--pairs`` calls per arm, alternating A B / B A, on the shapes data's val pictures
   rendered at ``--size`` (batch ``--batch``); the masks of both arms are compared once, bit for bit;
2. memory, one fresh process per arm and repeat (A B A B ...): the resident set's peak growth over one call on a
   ``--photo`` picture (default 3024x4032, a 12-megapixel phone photo: a val picture enlarged), with every
   detection the model makes above ``--photo-score`` (default 0: the detection limit, 50).

    python examples/mask_paste_ab.py
    python examples/mask_paste_ab.py --size 1024 --batch 2 --pairs 20 --memory-repeats 3

``--model``, ``--model-size`` and ``--state-batch`` pick another bench state (the tests run the tiny model's); the
state is the one ``bench train`` / ``bench infer`` make at that size and batch, whatever ``--batch`` the timing uses.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from lit_amp_det.bench import e2e, e2e_rows, infer
from lit_amp_det.bench.common import compose, shapes_batch
from lit_amp_det.models.mask_paste import BinaryMaskTransform

ROW = "channels-last"  # the last bench infer row before binary-mask-paste


def _build(args: argparse.Namespace, score_thresh: float | None = None):
    # the setting's batch is the state's: the timing's --batch only sets how many pictures a call takes
    setting = e2e_rows.Setting(device="cpu", model=args.model, batch=args.state_batch, height=args.model_size,
                               width=args.model_size, num_classes=e2e_rows.default_num_classes(args.model), steps=1,
                               warmup=0, compile_warmup=0, state="trained", state_steps=e2e.DEFAULT_STATE_STEPS,
                               half="fp32")
    setting, _ = e2e.prepare(setting, argparse.Namespace(cache_dir=None, peak_seconds=0.5), ["fp32"])
    rows = [row.name for row in infer.ROWS]
    overrides = e2e_rows.row_overrides(infer.ROWS, rows.index(ROW), setting)
    if score_thresh is not None:
        overrides.append(f"model.roi_heads.score_thresh={score_thresh}")
    built = e2e_rows.build(compose(overrides), "cpu", "predict")
    built.module.eval()
    plain = built.module.model.transform
    arms = {"A": plain, "B": BinaryMaskTransform(plain, built.module.hparams.mask_threshold).eval()}
    return setting, built, arms


def _call(built, arms, arm: str, batch: list[torch.Tensor]) -> tuple[float, list[dict[str, torch.Tensor]]]:
    built.module.model.transform = arms[arm]
    start = time.perf_counter()
    with torch.inference_mode(), built.plugin.forward_context():
        out = built.module(batch)
    return 1000 * (time.perf_counter() - start), out


def paired_time(args: argparse.Namespace) -> None:
    setting, built, arms = _build(args)
    images, _ = shapes_batch("val", range(args.batch), args.size, args.size, setting.num_classes, "cpu")
    _, a = _call(built, arms, "A", images)
    _, b = _call(built, arms, "B", images)
    assert all(torch.equal(x["masks"], y["masks"]) for x, y in zip(a, b)), "the arms' masks differ"
    detections = [len(d["masks"]) for d in a]
    times: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(args.pairs):
        for arm in ("AB" if i % 2 == 0 else "BA"):
            times[arm].append(_call(built, arms, arm, images)[0])
    diffs = [x - y for x, y in zip(times["A"], times["B"])]
    ratios = [x / y for x, y in zip(times["A"], times["B"])]
    q = statistics.quantiles(ratios, n=4)
    print(f"time: {args.size}x{args.size} pictures, batch {args.batch}, detections per picture {detections} (the same "
          f"masks in both arms): A {statistics.median(times['A']):.1f} ms, B {statistics.median(times['B']):.1f} ms a "
          f"call; paired A - B median {statistics.median(diffs):.1f} ms, A / B median {statistics.median(ratios):.2f}x "
          f"(quartiles {q[0]:.2f}, {q[2]:.2f}), B faster in {sum(d > 0 for d in diffs)}/{args.pairs} pairs", flush=True)


def memory_arm(args: argparse.Namespace) -> None:
    """One call on the photo in this (fresh) process; prints the resident set's peak growth as JSON."""
    setting, built, arms = _build(args, score_thresh=args.photo_score)
    small, _ = shapes_batch("val", range(1), args.model_size, args.model_size, setting.num_classes, "cpu")
    height, width = args.photo
    photo = F.interpolate(small[0][None].float(), size=(height, width), mode="bilinear").round().to(torch.uint8)[0]
    _call(built, arms, args.memory_arm, small)  # warm-up at the model's size
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    ms, out = _call(built, arms, args.memory_arm, [photo])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"arm": args.memory_arm, "peak_growth_mb": after - before, "ms": ms,
                      "detections": len(out[0]["masks"]), "mask_pixels": int(out[0]["masks"].sum())}))


def memory(args: argparse.Namespace) -> None:
    results: dict[str, list[dict]] = {"A": [], "B": []}
    for _ in range(args.memory_repeats):
        for arm in "AB":
            command = [sys.executable, __file__, "--memory-arm", arm, "--photo", *map(str, args.photo),
                       "--photo-score", str(args.photo_score), "--model", args.model,
                       "--model-size", str(args.model_size), "--state-batch", str(args.state_batch)]
            line = subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            results[arm].append(json.loads(line))
    a, b = results["A"], results["B"]
    assert {(r["detections"], r["mask_pixels"]) for r in a + b} == {(a[0]["detections"], a[0]["mask_pixels"])}
    growth = {arm: statistics.median(r["peak_growth_mb"] for r in rs) for arm, rs in results.items()}
    ms = {arm: statistics.median(r["ms"] for r in rs) for arm, rs in results.items()}
    # below 1 MB the resident set's granularity decides (a small photo): no ratio
    less = f"{growth['A'] / growth['B']:.1f}x less" if growth["B"] >= 1 else "B under 1 MB"
    print(f"memory: one {args.photo[0]}x{args.photo[1]} picture, {a[0]['detections']} detections (the same masks in "
          f"both arms), {args.memory_repeats} fresh processes per arm: peak resident growth A "
          f"{growth['A']:.0f} MB (runs {[round(r['peak_growth_mb']) for r in a]}), B {growth['B']:.0f} MB (runs "
          f"{[round(r['peak_growth_mb']) for r in b]}), {less}; the call A "
          f"{ms['A']:.0f} ms, B {ms['B']:.0f} ms ({ms['A'] / ms['B']:.1f}x)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=800, help="side of the pictures of the paired timing")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--photo", type=int, nargs=2, default=(3024, 4032), metavar=("HEIGHT", "WIDTH"))
    parser.add_argument("--photo-score", type=float, default=0.0)
    parser.add_argument("--memory-repeats", type=int, default=3)
    parser.add_argument("--model", default="maskrcnn_light", help="the bench state's model")
    parser.add_argument("--model-size", type=int, default=224, help="the bench state's (and the model's) image side")
    parser.add_argument("--state-batch", type=int, default=4, help="the bench state's batch")
    parser.add_argument("--memory-arm", choices=["A", "B"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_arm:
        memory_arm(args)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; bench infer row {ROW!r}, the trained "
          f"{args.model} state ({args.model_size} px in the model, batch {args.state_batch})", flush=True)
    paired_time(args)
    memory(args)


if __name__ == "__main__":
    main()

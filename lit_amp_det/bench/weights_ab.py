"""``python -m lit_amp_det bench weights_ab``: fp32 vs autocast vs low-precision weights, interleaved in one process.

The variants (``--variants``, default all):

* ``tv-fp32``: torchvision's ops, ``trainer.precision=32-true``, SGD without the fused kernel, no callbacks (the
  first row of ``bench train``);
* ``mixed``: all on -- ``bf16-mixed`` (``16-mixed`` on CUDA) with the fp32 regions, lit_amp_det's ops,
  channels_last, FreezeNorm + ConvBNEval, fused SGD;
* ``weights``: the same with ``bf16-weights`` (``16-weights`` on CUDA): bf16 weights, fp32 masters;
* ``mixed-tv-masks`` / ``weights-tv-masks``: those two with torchvision's per-image mask targets
  (``ExtRoIHeads.batched_mask_targets=False``), the A/B of the batched mask targets;
* ``weights-nchw``: ``weights`` with ``model.channels_last=false``;
* ``weights-unfused``: ``weights`` stepping the masters through the optimizer's hooks
  (``precision.fused_master_step=false``), the A/B of the fused master step;
* ``weights-matmul-up``: ``weights`` with ``model.deconv_as_matmul=true`` (the mask upsampling as one matmul);
* ``weights-labelled``: ``weights-matmul-up`` with ``model.labelled_mask_logits=true`` (own-class mask logits only,
  computed on the upsampling's patch-ordered product).

Every variant is built from the same seeded weights and steps on the same seeded batch with SGD at a fixed
learning rate (``--lr``, default 0: the weights, hence the proposals and the work of a step, stay the same in every
round). Each round times ``--steps`` steps of every variant, in an order rotated from round to round, so a
machine's slow spells spread over all variants; a variant's time is the median of all its timed steps, and the
ratios compare medians. Peak memory is measured afterwards, one step per variant: the process's peak resident set
above what it held before the step (freed memory handed back to the OS first, CPU), or the CUDA allocator's peak
above its in-use bytes. ``state MB`` is what a variant keeps between steps: parameters, buffers, fp32 masters and
their gradients, and optimizer state. ``--profile N`` then prints the top N ops of one more step of every variant
(``torch.profiler``, by self time).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lit_amp_det.bench.common import compose, detection_batch, train_step
from lit_amp_det.bench.e2e_rows import build, low_precision_weights, mixed_precision
from lit_amp_det.profiling import MB, MemoryProbe, release_freed_cpu_memory, synchronize, timed

__all__ = ["VARIANTS", "main"]

_TV_FP32 = ["callbacks=none", "optim=sgd", "optim.optimizer.fused=null", "trainer.precision=32-true",
            "precision.fp32_regions={}", "model.ops=torchvision", "model.channels_last=false",
            "model.deconv_as_matmul=false", "model.labelled_mask_logits=false", "model.compile=null"]
_ALL_ON = ["callbacks=[freeze_norm,conv_bn_eval]", "optim=sgd", "optim.optimizer.fused=auto",
           "precision.fp32_regions=null", "model.ops=ext", "model.channels_last=true", "model.compile=null"]

#: name -> (overrides, with ``{mixed}``/``{weights}`` for the device's precision, batched mask targets)
VARIANTS: dict[str, tuple[list[str], bool]] = {
    "tv-fp32": (_TV_FP32, True),
    "mixed": ([*_ALL_ON, "trainer.precision={mixed}"], True),
    "weights": ([*_ALL_ON, "trainer.precision={weights}"], True),
    "mixed-tv-masks": ([*_ALL_ON, "trainer.precision={mixed}"], False),
    "weights-tv-masks": ([*_ALL_ON, "trainer.precision={weights}"], False),
    "weights-nchw": ([*_ALL_ON, "trainer.precision={weights}", "model.channels_last=false"], True),
    "weights-unfused": ([*_ALL_ON, "trainer.precision={weights}", "precision.fused_master_step=false"], True),
    "weights-matmul-up": ([*_ALL_ON, "trainer.precision={weights}", "model.deconv_as_matmul=true"], True),
    "weights-labelled": ([*_ALL_ON, "trainer.precision={weights}", "model.deconv_as_matmul=true",
                          "model.labelled_mask_logits=true"], True),
}


@dataclass
class _Variant:
    name: str
    overrides: list[str]
    step: Callable[[], None]
    state_mb: float
    times: list[float] = field(default_factory=list)


def _state_mb(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """MB kept between steps: parameters, the optimizer's parameters (masters), their gradients and state
    (:func:`~lit_amp_det.callbacks.run_stats.resident_training_bytes`), and the module's buffers."""
    from lit_amp_det.callbacks.run_stats import resident_training_bytes

    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    return (resident_training_bytes(module, [optimizer]) + buffers) / MB


def _build(name: str, args: argparse.Namespace, batch: tuple[list, list]) -> _Variant:
    """One variant as ``fit`` builds it: callbacks' setup, the plugin's convert_module, the device, the optimizer
    (fixed lr, no schedule) connected through the plugin (which points it at fp32 masters where there are some)."""
    from lit_amp_det.optim import build_optimizer

    cuda = args.device == "cuda"
    overrides, batched_masks = VARIANTS[name]
    size = [f"model.transform.min_size={min(args.size)}", f"model.transform.max_size={max(args.size)}"]
    half = "fp16" if cuda else "bf16"  # the A/B is about half-precision weights, with or without native bf16
    precisions = {"{mixed}": mixed_precision(args.device, half), "{weights}": low_precision_weights(args.device, half)}
    for placeholder, precision in precisions.items():
        overrides = [o.replace(placeholder, precision) for o in overrides]
    cfg = compose([f"trainer={'gpu' if cuda else 'cpu'}", f"model={args.model}", f"model.num_classes={args.classes}",
                   *size, *overrides])
    built = build(cfg, args.device, "fit")  # seeded weights, callbacks' setup, fp32 regions, device: as fit does
    module, plugin, callbacks = built.module, built.plugin, built.callbacks
    if not batched_masks:
        module.model.roi_heads.batched_mask_targets = False
    optimizer = build_optimizer({**module.hparams.optimizer, "lr": args.lr},
                                [p for p in module.parameters() if p.requires_grad])
    plugin.connect(module, [optimizer], [])
    module.train()
    for callback in callbacks:
        callback.on_fit_start(None, module)
        callback.on_train_epoch_start(None, module)
    images, targets = batch

    def step() -> None:
        for callback in callbacks:
            callback.on_train_batch_start(None, module, batch, 0)
        train_step(module, plugin, optimizer, images, targets)

    step()  # creates gradients and optimizer state before they are counted
    return _Variant(name, cfg_overrides(cfg), step, _state_mb(module, optimizer))


def cfg_overrides(cfg: Any) -> list[str]:
    """The switches that differ between variants, as this process composed them."""
    return [f"trainer.precision={cfg.trainer.precision}", f"model.ops={cfg.model.ops}",
            f"model.channels_last={cfg.model.channels_last}", f"optim.optimizer.fused={cfg.optim.optimizer.fused}",
            f"precision.fp32_regions={cfg.precision.fp32_regions}"]


def _peak_step_mb(variant: _Variant, device: str) -> float:
    probe = MemoryProbe(device)
    gc.collect()
    if device == "cpu":
        release_freed_cpu_memory()
    before = probe.baseline_bytes()
    probe.reset_peak()
    variant.step()
    probe.synchronize()
    return (probe.peak_bytes() - before) / MB


def _profile(variant: _Variant, device: str, rows: int) -> str:
    """``torch.profiler``'s table of one step of ``variant``, the ``rows`` ops with the most self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device == "cuda" else [])]
    with profile(activities=activities) as prof:
        variant.step()
        synchronize(torch.device(device))
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m lit_amp_det bench weights_ab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="maskrcnn_r50_fpn", help="model config (conf/model/*.yaml)")
    parser.add_argument("--classes", type=int, default=None, help="classes incl. background (81 for R50, else 7)")
    parser.add_argument("--size", type=int, nargs="+", default=[256], help="SIDE or HEIGHT WIDTH (default 256)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant before the rounds")
    parser.add_argument("--lr", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the top N ops (self time) of one profiled step per variant")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    args.size = (args.size[0], args.size[0]) if len(args.size) == 1 else tuple(args.size[:2])
    args.classes = args.classes or (81 if args.model == "maskrcnn_r50_fpn" else 7)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        parser.error(f"--variants {unknown or '(empty)'}: choose from {list(VARIANTS)}")
    return args


def _table(results: dict[str, dict[str, Any]], batch: int) -> str:
    first = next(iter(results))
    reference = "mixed" if "mixed" in results else first
    lines = [f"| variant | step ms (median) | IQR ms | images/s | vs {first} | vs {reference} | peak step MB | "
             "state MB |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['step_ms']:.0f} | {r['iqr_ms']:.0f} | {batch * 1000 / r['step_ms']:.2f} | "
                     f"{results[first]['step_ms'] / r['step_ms']:.2f}x | "
                     f"{results[reference]['step_ms'] / r['step_ms']:.2f}x | {r['peak_step_mb']:.0f} | "
                     f"{r['state_mb']:.0f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = _parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    images, targets = detection_batch(args.batch, *args.size, args.device)
    batch = ([(image * 255).to(torch.uint8) for image in images], targets)
    variants = [_build(name, args, batch) for name in args.variants]
    for variant in variants:
        for _ in range(args.warmup):
            variant.step()
    for round_index in range(args.rounds):
        shift = round_index % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            variant.times += [timed(variant.step, args.device) for _ in range(args.steps)]
    results = {}
    for variant in variants:
        ms = sorted(1000 * t for t in variant.times)
        q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else (ms[0],) * 3
        results[variant.name] = {"step_ms": statistics.median(ms), "iqr_ms": q3 - q1, "times_ms": ms,
                                 "state_mb": variant.state_mb, "switches": variant.overrides}
    for variant in variants:
        results[variant.name]["peak_step_mb"] = _peak_step_mb(variant, args.device)
    print(f"{args.model} {args.size[0]}x{args.size[1]} batch {args.batch} on {args.device} "
          f"({torch.get_num_threads()} threads), {args.rounds} rounds x {args.steps} steps, lr {args.lr}")
    print(_table(results, args.batch))
    for variant in variants if args.profile else []:
        print(f"\n{variant.name}: top {args.profile} ops of one step")
        print(_profile(variant, args.device, args.profile))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, "results": results},
                                              indent=2, default=str))


if __name__ == "__main__":
    main()

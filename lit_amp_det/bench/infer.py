"""``python -m lit_amp_det bench infer``: Mask R-CNN inference latency and throughput as optimisations add up.

Rows, each the previous row's Hydra overrides plus the one shown (see :mod:`lit_amp_det.bench.e2e_rows`):

1. torchvision fp32 eager: torchvision's own ops, ``trainer.precision=32-true``, no callbacks;
2. ``trainer.precision=16-mixed`` (CUDA; ``bf16-mixed`` on a CPU); with the baseline's
   ``precision.fp32_regions={}`` that is plain ``torch.autocast`` around the forward;
3. ``precision.fp32_regions=null``: the precision plugin's fp32 regions (proposal filtering, box decoding,
   detection post-processing and mask pasting in fp32);
4. ``model.ops=ext``: lit_amp_det's NMS and RoIAlign kernels;
5. ``model.channels_last=true``;
6. ``model.binary_mask_paste=true``: each detection's mask pasted into the image as booleans, box by box, instead
   of torchvision's float canvas per detection (:mod:`lit_amp_det.models.mask_paste`; the same masks);
7. ``callbacks=[conv_bn_eval]``: ConvBNEval as ``predict`` runs it by default, each conv-BN pair folded on
   the fly (without an autograd graph every pair folds);
8. ``callbacks.conv_bn_eval.fold_on_predict=true``: the pairs folded once, permanently, before prediction
   (:func:`lit_amp_det.models.conv_bn.fold_conv_bn`; norms become ``nn.Identity``), the inference-time
   conv-BN switch;
9. ``model.deconv_as_matmul=true``: the mask head's upsampling as one matrix product (fp16/bf16; fp32 on AVX2);
10. ``model.labelled_mask_logits=true``: each detection's mask logits of its predicted class only, the one map of
   all ``num_classes`` that torchvision's ``maskrcnn_inference`` keeps;
11. ``model.pointwise_conv_as_matmul=true``: the backbone's and FPN's 1x1 convolutions as matrix products;
12. ``model.winograd_convs=[mask_head,rpn_head,fpn]``: Winograd F(2x2, 3x3) for the 3x3 layers large enough for it
    (in fp16/bf16 256 channels or more: the R50-FPN; in fp32 from 64 channels on large maps,
    :func:`lit_amp_det.models.winograd_conv.winograd_pays`);
13. ``model.winograd_convs=[mask_head,rpn_head,fpn,backbone]``: the ResNet's stride-1 3x3 layers as well;
14. ``model.winograd_output_tile=4``: those layers by F(4x4, 3x3) tiles where they compute in fp32;
15. ``model.winograd_weight_tile_cache=true``: those layers keep their weight's tiles from call to call
    (:class:`lit_amp_det.models.winograd_conv.WeightTileCache`; the tiles' memory counts in the peak);
16. ``model.compile=backbone``: ``torch.compile`` of the ResNet+FPN (``--compile-warmup`` untimed calls per
    batch size).

Rows 9-14 are the training bench's switches of the same names (:mod:`lit_amp_det.bench.train`).

A call is what ``predict`` runs per batch: ``MaskRCNNModule.forward`` (detector and post-processing: fp32
boxes, scores, thresholded masks pasted at image size) inside the plugin's context under
``torch.inference_mode()``, the model in eval mode after the callbacks' ``setup`` and ``on_predict_start``.
Every row loads the same weights (``--state``; by default the trained state of
:mod:`lit_amp_det.bench.state`, whose detections are real ones) and calls on the same shapes images. Columns:
latency at batch 1 (median over repeats of each repeat's median, the min-max of the repeat medians, IQR),
throughput at ``--batch`` (images per second from the median call), GFLOP per call at ``--batch`` and achieved
GFLOP/s with the fraction of the device's peak, peak memory above the built model (of one call at ``--batch`` after
the timed calls, :class:`~lit_amp_det.bench.e2e_rows.PeakMemory`), ratios to the first row, each repeat's copy
probe of the host's phase before its warm-up and after its timed calls (:mod:`lit_amp_det.bench.host_probe`), with
``--drift-steps N`` how much the heap in use and the resident set grow over N more calls at ``--batch`` on images
that change every call (the shapes data's val split: new proposal and detection counts, so new matmul shapes,
every call; :func:`~lit_amp_det.bench.e2e_rows.memory_over_changing_batches`), and the warm-up time. Post-processing
work follows the detections, which can differ a little between precisions. Defaults: R50-FPN at 800x1333, batch 8,
5 + 20 calls on CUDA; the light model at 224 px, batch 4, 3 + 10 calls on a CPU; 3 repeats.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from lit_amp_det.bench import e2e, e2e_rows
from lit_amp_det.bench.common import batch_sha256, compose
from lit_amp_det.bench.e2e_report import previous_ratio_text, ratio_text, repeat_text, roofline_text
from lit_amp_det.bench.roofline import compute_dtype, count_flops
from lit_amp_det.bench.e2e_rows import Row, Setting
from lit_amp_det.bench.host_probe import PROBE_MB, CopyProbe, probe_text
from lit_amp_det.bench.train import ROWS as TRAIN_ROWS
from lit_amp_det.models.conv_bn import NORM_TYPES
from lit_amp_det.profiling import timed

__all__ = ["BENCH", "ROWS", "main", "run_row"]

_TRAIN_ROW = {row.name: row for row in TRAIN_ROWS}

ROWS = (
    *TRAIN_ROWS[:5],  # torchvision fp32, autocast, fp32 regions, ext ops, channels_last
    Row("binary-mask-paste", "+ masks pasted as booleans", "model.binary_mask_paste=true"),
    Row("convbn-eval", "+ ConvBNEval (fold on the fly)", "callbacks=[conv_bn_eval]"),
    Row("convbn-fold", "+ conv-BN folded once", "callbacks.conv_bn_eval.fold_on_predict=true"),
    *(_TRAIN_ROW[name] for name in ("deconv-matmul", "labelled-mask-logits", "pointwise-matmul", "winograd",
                                    "winograd-backbone", "winograd-4x4")),
    Row("weight-tile-cache", "+ Winograd weight tiles kept", "model.winograd_weight_tile_cache=true"),
    Row("compile", "+ torch.compile backbone", "model.compile=backbone"),
)


def run_row(index: int, setting: Setting) -> dict[str, Any]:
    """Times ``setting.steps`` eval calls at batch 1 and at ``setting.batch`` of ``ROWS[index]`` in this process."""
    cfg = compose(e2e_rows.row_overrides(ROWS, index, setting))
    probe = CopyProbe(setting.device)  # before the model: its buffers count in no memory figure
    start = time.perf_counter()
    built = e2e_rows.build(cfg, setting.device, "predict")
    module, plugin = built.module, built.plugin
    module.eval()  # Lightning's predict loop does this before on_predict_start
    for callback in built.callbacks:
        callback.on_predict_start(None, module)
    images, _ = e2e_rows.synthetic_batch(setting, setting.batch)
    memory = e2e_rows.PeakMemory(setting.device)
    build_s = time.perf_counter() - start
    detections: list[int] = []

    def call(batch: list[torch.Tensor]) -> None:
        with torch.inference_mode(), plugin.forward_context():
            predictions = module(batch)
        detections.append(sum(len(p["boxes"]) for p in predictions))

    warmup = setting.compile_warmup if cfg.model.compile else setting.warmup
    # every batch size warms up before anything is timed (compile traces each input shape)
    probe_before = probe.gbps()
    warmup_s = sum(timed(lambda: call(images[:1]), setting.device) for _ in range(warmup))
    warmup_s += sum(timed(lambda: call(images), setting.device) for _ in range(warmup))
    latency = e2e_rows.summarise([timed(lambda: call(images[:1]), setting.device) for _ in range(setting.steps)],
                                 "latency")
    throughput = e2e_rows.summarise([timed(lambda: call(images), setting.device) for _ in range(setting.steps)],
                                    "batch")
    host_copy_gbps = [probe_before, probe.gbps()]
    flops = count_flops(lambda: call(images))  # one more call at --batch, after the timed ones
    peak = memory.peak_of(lambda: call(images))  # and one more: it pins the CPU allocator
    del detections[-2:]
    detections_per_call = detections[-1]
    drift = e2e_rows.memory_over_changing_batches(lambda k, batch: call(batch[0]), setting, "val")
    precision = getattr(plugin, "precision", str(cfg.trainer.precision))
    return {
        **latency,
        **throughput,
        "images_per_s": setting.batch * 1000 / throughput["batch_ms_median"],
        **peak,
        **drift,
        "memory_method": memory.method,
        "host_copy_gbps": host_copy_gbps,
        "gflop_per_step": flops / 1e9,
        "compute_dtype": compute_dtype(precision),
        "weights_sha256": built.weights_sha256,
        "batch_sha256": batch_sha256(images, []),
        "build_s": build_s,
        "warmup_steps": warmup,
        "warmup_s": warmup_s,
        "detections_per_call": detections_per_call,
        "norm_layers": sum(isinstance(m, NORM_TYPES) for m in module.modules()),  # 0 once folded
        "switches": e2e_rows.switches(cfg, built),
    }


def _ratios(row: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    return {"latency_speedup": base["latency_ms_median"] / row["latency_ms_median"],
            "throughput_speedup": row["images_per_s"] / base["images_per_s"],
            "memory_ratio": e2e_rows.memory_ratio(row, base)}


BENCH = e2e_rows.Bench(
    kind="infer",
    doc=__doc__,
    rows=ROWS,
    run_row=run_row,
    ratios=_ratios,
    columns=(
        ("latency ms (batch 1, median)", lambda r: f"{r['latency_ms_median']:.1f}"),
        ("repeats ms", lambda r: repeat_text(r, "latency", ".1f")),
        ("IQR ms", lambda r: f"{r['latency_ms_iqr']:.1f}"),
        ("latency speed-up", lambda r: ratio_text(r.get("latency_speedup"), suffix="x")),
        ("images/s (batch)", lambda r: f"{r['images_per_s']:.2f}"),
        ("batch ms (median, IQR)", lambda r: f"{r['batch_ms_median']:.0f} ({r['batch_ms_iqr']:.0f})"),
        ("batch repeats ms", lambda r: repeat_text(r, "batch")),
        ("throughput speed-up", lambda r: ratio_text(r.get("throughput_speedup"), suffix="x")),
        ("throughput vs row above", lambda r: previous_ratio_text(r, "throughput_speedup")),
        ("GFLOP/call (batch)", lambda r: ratio_text(r.get("gflop_per_step"), ".1f")),
        ("GFLOP/s (% of peak)", roofline_text),
        ("peak MB", lambda r: f"{r['peak_memory_mb']:.0f}"),
        ("memory ratio", lambda r: ratio_text(r.get("memory_ratio"), suffix="x")),
        (f"{PROBE_MB} MB copy GB/s, before-after (each repeat)", probe_text),
        e2e_rows.DRIFT_COLUMN,
        ("warm-up s", lambda r: f"{r['warmup_s']:.1f} ({r['warmup_steps']}+{r['warmup_steps']} calls)"),
    ),
    panels=(("latency_speedup", "batch-1 latency speed-up vs first row"),
            ("throughput_speedup", "images/s vs first row (higher is better)"),
            ("memory_ratio", "peak memory vs first row (lower is better)")),
    timings=("latency", "batch"),
    flop_timing="batch",
)


def main(argv: Sequence[str] | None = None) -> None:
    e2e.main(BENCH, argv)


if __name__ == "__main__":
    main()

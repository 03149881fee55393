"""``python -m lit_amp_det bench train``: Mask R-CNN training throughput as lit_amp_det's optimisations add up.

Rows, each the previous row's Hydra overrides plus the one shown (see :mod:`lit_amp_det.bench.e2e_rows`):

1. torchvision fp32 eager: torchvision's own ops, ``trainer.precision=32-true``, SGD (momentum 0.9,
   ``conf/optim/sgd.yaml``) without the fused kernel, no callbacks;
2. ``trainer.precision=16-mixed`` (CUDA; ``bf16-mixed`` on a CPU); with the baseline's
   ``precision.fp32_regions={}`` that is plain ``torch.autocast`` around the forward and loss (plus a
   GradScaler for fp16), what a torchvision user would write;
3. ``precision.fp32_regions=null``: lit_amp_det's precision plugin with its fp32 regions (losses, box
   coding, proposal filtering in fp32);
4. ``model.ops=ext``: lit_amp_det's NMS, RoIAlign and IoU kernels;
5. ``model.channels_last=true``;
6. ``callbacks=[freeze_norm,conv_bn_eval]``: BatchNorm kept in eval mode (``norm_eval``; the R50-FPN's
   FrozenBatchNorm2d is frozen already, while the light/tiny models' trainable BatchNorm stops using batch
   statistics here, the fine-tuning recipe) and tune-mode conv-BN folding on top;
7. ``optim.optimizer.fused=auto``: the fused SGD kernel (on the CPU through ``lit_amp_det.optim.SGD``, which
   skips PyTorch's per-step copy of channels_last gradients: ``optim.optimizer.memory_order_views``);
8. ``trainer.precision=16-weights`` (CUDA; ``bf16-weights`` on a CPU): the weights themselves in half precision
   with fp32 masters in the optimizer, no autocast (:mod:`lit_amp_det.precision.master_weights`);
9. ``model.deconv_as_matmul=true``: the mask head's 2x2 stride-2 transposed convolution as one matrix product in
   fp16/bf16, and in fp32 on an AVX2 CPU (:mod:`lit_amp_det.models.patch_deconv`);
10. ``precision.fused_master_step=true``: the half-weights mode's SGD step in one pass from the half-precision
    gradients, no fp32 gradients (:mod:`lit_amp_det.precision.fused_master_step`; a no-op for fp16 on CUDA,
    whose GradScaler steps through the hooks);
11. ``callbacks=[freeze_norm,conv_bn_eval,retain_cpu_heap]``: glibc keeps the heap a step frees for the next step
    (:class:`~lit_amp_det.callbacks.retain_cpu_heap.RetainCPUHeap`; CPU only), so steps stop faulting pages in;
12. ``model.labelled_mask_logits=true``: the training mask loss from each positive RoI's own-class logits only,
    one dot product per pixel instead of ``num_classes`` (:mod:`lit_amp_det.models.labelled_mask_logits`);
13. ``model.pointwise_conv_as_matmul=true``: the backbone's and FPN's 1x1 convolutions as matrix products in
    fp16/bf16 on channels_last maps (:mod:`lit_amp_det.models.pointwise_conv`);
14. ``model.winograd_convs=[mask_head,rpn_head,fpn]``: the heads' and FPN's 3x3 convolutions by Winograd F(2x2, 3x3)
    tiles in fp16/bf16/fp32 on the CPU, where a layer is large enough for its dtype
    (:mod:`lit_amp_det.models.winograd_conv`);
15. ``model.winograd_convs=[mask_head,rpn_head,fpn,backbone]``: the ResNet's stride-1 3x3 convolutions as well;
16. ``model.winograd_output_tile=4``: those layers by F(4x4, 3x3) tiles where they compute in fp32 (1.78x fewer
    multiplications than F(2x2, 3x3); it changes nothing in fp16/bf16, so fp16/bf16 runs leave it out unless
    ``--rows`` names it);
17. ``model.compile=backbone``: ``torch.compile`` of the ResNet+FPN (``--compile-warmup`` untimed steps).

A step is what Lightning's automatic optimisation runs for :class:`~lit_amp_det.MaskRCNNModule`: the
FreezeNorm batch hook, forward and ``compute_loss`` inside the plugin's autocast context, ``zero_grad``,
backward (scaled for fp16), the plugin's non-finite-gradient check and optimizer step, scheduler step;
Lightning's own overhead (logging, hooks) is left out. Every row starts from the same weights (``--state``) and
times the same batch of shapes images. With the trained state (the default) each row builds a fresh
optimizer of its own config (the fused kernel is a row's switch, and FreezeNorm changes which tensors are
parameters, so saved optimizer state could not be shared) at the constant learning rate the state's schedule
ended at: every row gets the same optimizer state and learning rate, and the small rate keeps the weights, and
so the proposal counts that set a step's time, at the loaded state through warm-up and timing. With
``--state random`` the recipe's warm-up schedule runs from step 0, as in a fresh run.

Columns: images/s (batch / median step time), step time (median over repeats of each repeat's median), the
min-max of the repeat medians, IQR of the timed steps, GFLOP per step and achieved GFLOP/s with the fraction of
the device's peak (:mod:`lit_amp_det.bench.roofline`), peak memory of one more step above the built model, ratios
to the first row, each repeat's minor page faults per timed step, each repeat's copy probe of the host's phase
before its warm-up and after its timed steps (:mod:`lit_amp_det.bench.host_probe`), with ``--drift-steps N`` how
much the heap in use and the resident set grow over N more steps on batches that change every step
(:func:`~lit_amp_det.bench.e2e_rows.memory_over_changing_batches`), and the warm-up time (which holds the compile
time). Defaults: R50-FPN at 800x1333, batch 8, 5 + 20 steps on CUDA; the light model (ResNet-18 FPN) at 224 px,
batch 4, 3 + 10 steps on a CPU; 3 repeats.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lit_amp_det.bench import e2e, e2e_rows
from lit_amp_det.bench.breakdown import time_breakdown
from lit_amp_det.bench.common import batch_sha256, compose, train_step
from lit_amp_det.bench.e2e_report import each_repeat_text, previous_ratio_text, ratio_text, repeat_text, roofline_text
from lit_amp_det.bench.roofline import compute_dtype, count_flops
from lit_amp_det.bench.e2e_rows import Row, Setting
from lit_amp_det.bench.host_probe import PROBE_MB, CopyProbe, probe_text
from lit_amp_det.models.winograd_conv import WinogradConv2d, direct_convolutions
from lit_amp_det.profiling import minor_page_faults, timed

__all__ = ["BENCH", "ROWS", "PreparedRow", "main", "prepare_row", "run_row"]

ROWS = (
    Row("torchvision-fp32", "torchvision fp32 eager", None),
    Row("autocast", "+ torch.autocast", "trainer.precision={mixed}", needs_half=True),
    Row("fp32-regions", "+ precision plugin (fp32 regions)", "precision.fp32_regions=null", needs_half=True),
    Row("ext-ops", "+ lit_amp_det ops", "model.ops=ext"),
    Row("channels-last", "+ channels_last", "model.channels_last=true"),
    Row("freeze-norm-convbn", "+ FreezeNorm + ConvBNEval", "callbacks=[freeze_norm,conv_bn_eval]"),
    Row("fused-optim", "+ fused SGD", "optim.optimizer.fused=auto"),
    Row("low-precision-weights", "+ half weights, fp32 masters", "trainer.precision={weights}", needs_half=True),
    Row("deconv-matmul", "+ mask upsampling as one matmul", "model.deconv_as_matmul=true"),
    Row("fused-master-step", "+ fused master SGD step", "precision.fused_master_step=true", needs_half=True),
    Row("retain-cpu-heap", "+ retained CPU heap", "callbacks=[freeze_norm,conv_bn_eval,retain_cpu_heap]"),
    Row("labelled-mask-logits", "+ own-class mask logits only", "model.labelled_mask_logits=true"),
    Row("pointwise-matmul", "+ 1x1 convs as matmuls", "model.pointwise_conv_as_matmul=true", needs_half=True),
    Row("winograd", "+ Winograd 3x3 convs", "model.winograd_convs=[mask_head,rpn_head,fpn]"),
    Row("winograd-backbone", "+ Winograd in the backbone too",
        "model.winograd_convs=[mask_head,rpn_head,fpn,backbone]"),
    Row("winograd-4x4", "+ Winograd F(4x4) tiles in fp32", "model.winograd_output_tile=4", needs_fp32=True),
    Row("compile", "+ torch.compile backbone", "model.compile=backbone"),
)


@dataclass
class PreparedRow:
    """``ROWS[index]``'s model, plugin, callbacks, optimizer and schedule, built from the row's config and in
    training mode: what :func:`run_row` times, and what ``examples/paired_step_ab.py`` steps side by side."""

    cfg: Any
    built: e2e_rows.Built
    optimizer: torch.optim.Optimizer
    scheduler: Any | None
    warmup: int  #: untimed steps before the timed ones (the compile warm-up for a compiled row)
    build_s: float

    def step(self, batch_idx: int, images: list[torch.Tensor], targets: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """One training step as fit runs it: the callbacks' batch hook, :func:`train_step`, the schedule."""
        module = self.built.module
        for callback in self.built.callbacks:
            callback.on_train_batch_start(None, module, (images, targets), batch_idx)
        loss = train_step(module, self.built.plugin, self.optimizer, images, targets)
        if self.scheduler is not None:
            self.scheduler.step()
        return loss

    def teardown(self) -> None:
        """As fit ends; RetainCPUHeap hands the process's heap policy back (rows also run in process)."""
        for callback in self.built.callbacks:
            callback.teardown(None, self.built.module, "fit")


def prepare_row(index: int, setting: Setting) -> PreparedRow:
    """Builds ``ROWS[index]`` for ``setting``: configure_optimizers' optimizer and schedule (it needs a Trainer for
    the step count), connected to the plugin as the Trainer does, and the callbacks' fit and epoch starts run."""
    from hydra.utils import instantiate

    from lit_amp_det.optim import build_optimizer, warmup_schedule

    cfg = compose(e2e_rows.row_overrides(ROWS, index, setting))
    start = time.perf_counter()
    built = e2e_rows.build(cfg, setting.device, "fit")
    module = built.module
    optimizer = build_optimizer(module.hparams.optimizer, [p for p in module.parameters() if p.requires_grad])
    built.plugin.connect(module, [optimizer], [])  # as the Trainer does: low-precision weights step fp32 masters
    warmup = setting.compile_warmup if cfg.model.compile else setting.warmup
    scheduler = None
    if setting.lr is not None:  # the trained state: its schedule's last lr, held
        for group in optimizer.param_groups:
            group["lr"] = setting.lr
        scheduler = warmup_schedule(optimizer, total_steps=warmup + setting.steps, warmup_steps=0, policy="constant")
    elif module.hparams.scheduler:
        scheduler = instantiate(dict(module.hparams.scheduler), optimizer=optimizer,
                                total_steps=warmup + setting.steps)
    module.train()
    for callback in built.callbacks:
        callback.on_fit_start(None, module)
        callback.on_train_epoch_start(None, module)
    return PreparedRow(cfg, built, optimizer, scheduler, warmup, time.perf_counter() - start)


def run_row(index: int, setting: Setting) -> dict[str, Any]:
    """Times ``setting.steps`` training steps of ``ROWS[index]`` in this process."""
    probe = CopyProbe(setting.device)  # before the model: its buffers count in no memory figure
    row = prepare_row(index, setting)
    cfg, built, optimizer, warmup = row.cfg, row.built, row.optimizer, row.warmup
    module, plugin = built.module, built.plugin
    images, targets = e2e_rows.synthetic_batch(setting, setting.batch)
    memory = e2e_rows.PeakMemory(setting.device)
    losses: list[torch.Tensor] = []

    def step(batch_idx: int, batch: tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]] | None = None) -> None:
        step_images, step_targets = (images, targets) if batch is None else batch
        losses.append(row.step(batch_idx, step_images, step_targets).detach())

    try:
        probe_before = probe.gbps()
        warmup_s = sum(timed(lambda i=i: step(i), setting.device) for i in range(warmup))
        faults = minor_page_faults()
        times = [timed(lambda i=i: step(warmup + i), setting.device) for i in range(setting.steps)]
        faults = (minor_page_faults() - faults) / setting.steps
        host_copy_gbps = [probe_before, probe.gbps()]
        untimed = itertools.count(warmup + setting.steps)  # the indices of the steps after the timed ones
        peak = None
        if memory.measures_the_kept_heap:  # in the state the training steps left, before the instrumented ones
            peak = memory.peak_of(lambda: step(next(untimed)))
        flops = count_flops(lambda: step(next(untimed)))  # one more step, after the timed ones
        model_flops = flops
        if any(isinstance(m, WinogradConv2d) for m in module.modules()):  # and the same step done directly
            with direct_convolutions():
                model_flops = count_flops(lambda: step(next(untimed)))
        where = time_breakdown(lambda: step(next(untimed)), setting.device, flops / 1e9)  # and one more
        if peak is None:
            peak = memory.peak_of(lambda: step(next(untimed)))  # it pins the CPU allocator: after the others
        first_drift_step = next(untimed)
        drift = e2e_rows.memory_over_changing_batches(lambda k, batch: step(first_drift_step + k, batch), setting,
                                                      "train")
    finally:
        row.teardown()
    stats = e2e_rows.summarise(times)
    del losses[warmup + setting.steps:]  # those of the counting, profiled, peak and changing-batch steps
    precision = getattr(plugin, "precision", str(cfg.trainer.precision))
    return {
        **stats,
        "images_per_s": setting.batch * 1000 / stats["step_ms_median"],
        **peak,
        **drift,
        "memory_method": memory.method,
        "page_faults_per_step": faults,
        "host_copy_gbps": host_copy_gbps,
        "gflop_per_step": flops / 1e9,
        "model_gflop_per_step": model_flops / 1e9,
        **where,
        "compute_dtype": compute_dtype(precision),
        "weights_sha256": built.weights_sha256,
        "batch_sha256": batch_sha256(images, targets),
        "lr": optimizer.param_groups[0]["lr"],
        "build_s": row.build_s,
        "warmup_steps": warmup,
        "warmup_s": warmup_s,
        "losses": [float(loss) for loss in losses],
        "switches": e2e_rows.switches(cfg, built),
        "optimizer": {"type": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                      "fused": bool(optimizer.defaults.get("fused")),
                      "foreach": optimizer.defaults.get("foreach")},
    }


def _faults_text(row: dict[str, Any]) -> str:
    """Each repeat's minor page faults per timed step, in run order: a repeat that faults its activations in every
    step (glibc handing them back to the OS) reads slower for that reason alone."""
    return each_repeat_text(row, lambda r: f"{r['page_faults_per_step']:.0f}" if "page_faults_per_step" in r else "-")


def _ratios(row: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    return {"speedup": row["images_per_s"] / base["images_per_s"],
            "memory_ratio": e2e_rows.memory_ratio(row, base)}


BENCH = e2e_rows.Bench(
    kind="train",
    doc=__doc__,
    rows=ROWS,
    run_row=run_row,
    ratios=_ratios,
    columns=(
        ("images/s", lambda r: f"{r['images_per_s']:.2f}"),
        ("speed-up", lambda r: ratio_text(r.get("speedup"), suffix="x")),
        ("vs row above", lambda r: previous_ratio_text(r, "speedup")),
        ("step ms (median)", lambda r: f"{r['step_ms_median']:.0f}"),
        ("repeats ms", lambda r: repeat_text(r, "step")),
        ("IQR ms", lambda r: f"{r['step_ms_iqr']:.0f}"),
        ("GFLOP/step", lambda r: ratio_text(r.get("gflop_per_step"), ".1f")),
        ("GFLOP/s (% of peak)", roofline_text),
        ("peak MB", lambda r: f"{r['peak_memory_mb']:.0f}"),
        ("memory ratio", lambda r: ratio_text(r.get("memory_ratio"), suffix="x")),
        ("page faults/step (each repeat)", _faults_text),
        (f"{PROBE_MB} MB copy GB/s, before-after (each repeat)", probe_text),
        e2e_rows.DRIFT_COLUMN,
        ("warm-up s", lambda r: f"{r['warmup_s']:.1f} ({r['warmup_steps']} steps)"),
    ),
    panels=(("speedup", "images/s vs first row (higher is better)"),
            ("memory_ratio", "peak memory vs first row (lower is better)")),
)


def main(argv: Sequence[str] | None = None) -> None:
    e2e.main(BENCH, argv)


if __name__ == "__main__":
    main()

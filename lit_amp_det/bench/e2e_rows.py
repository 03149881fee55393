"""The rows of ``bench train`` and ``bench infer``: what a row is, how its config is composed and built, and
how its steps are measured.

A row is a list of Hydra overrides: the first switches every optimisation off (:data:`BASELINE`), every
later one adds exactly one override to the row above, so each row's gain is that one switch's. A row is built
the way ``fit``/``predict`` build it, so the bench measures what a user runs. Every row loads the same model
state (``Setting.checkpoint``, made by :mod:`lit_amp_det.bench.state`, or the seeded initialisation) and times
the same batch of shapes images, so rows differ in their switches only. Methodology and figures:
BENCHMARKS.md, "End to end".
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from lit_amp_det.bench.common import shapes_batch, weights_sha256
from lit_amp_det.bench.roofline import compute_dtype
from lit_amp_det.cpu_heap import heap_in_use_bytes, retains_freed_memory
from lit_amp_det.precision.hardware import auto_precision
from lit_amp_det.profiling import (MB, MemoryProbe, pin_malloc_threshold, release_freed_cpu_memory,
                                   resident_bytes, unpin_malloc_threshold)

__all__ = [
    "BASELINE",
    "DRIFT_COLUMN",
    "Bench",
    "Built",
    "Column",
    "PeakMemory",
    "Row",
    "Setting",
    "baseline_overrides",
    "build",
    "default_num_classes",
    "device_defaults",
    "drift_text",
    "memory_over_changing_batches",
    "memory_ratio",
    "HALF_CHOICES",
    "default_half",
    "half_overrides",
    "resolve_half",
    "setting_half",
    "low_precision_weights",
    "mixed_precision",
    "row_overrides",
    "setting_overrides",
    "summarise",
    "switches",
    "synthetic_batch",
]

#: Overrides of the first row: every optimisation off. ``precision.fp32_regions={}`` has no effect in fp32;
#: it makes the autocast row plain autocast, so that the next row can switch the regions on by itself.
BASELINE = (
    "callbacks=none",
    "optim=sgd",
    "optim.optimizer.fused=null",
    "trainer.precision=32-true",
    "precision.fp32_regions={}",
    "model.ops=torchvision",
    "model.channels_last=false",
    "model.deconv_as_matmul=false",
    "precision.fused_master_step=false",
    "model.labelled_mask_logits=false",
    "model.pointwise_conv_as_matmul=false",
    "model.winograd_convs=[]",
    "model.winograd_output_tile=2",
    "model.winograd_weight_tile_cache=false",
    "model.binary_mask_paste=false",
    "model.compile=null",
)


@dataclass(frozen=True)
class Row:
    """One row: ``override`` (``None`` for the baseline row) switches one optimisation on.

    ``{mixed}`` in the override stands for the run's mixed precision (see :func:`mixed_precision`),
    ``{weights}`` for its low-precision-weights twin (:func:`low_precision_weights`). ``needs_half``: the row
    changes nothing when the run's half precision is fp32 (``--precision fp32``, or ``auto`` on a CPU without
    native bf16), so it is left out of such runs unless ``--rows`` names it. ``needs_fp32``: the converse, a switch
    that acts on fp32 layers only (left out of fp16/bf16 runs unless named).
    """

    name: str
    label: str
    override: str | None
    needs_half: bool = False
    needs_fp32: bool = False

    def override_on(self, setting: Setting) -> str | None:
        """The override with ``{mixed}`` / ``{weights}`` filled in for ``setting``'s device and half precision."""
        if self.override is None:
            return None
        return self.override.format(mixed=mixed_precision(setting.device, setting.half),
                                    weights=low_precision_weights(setting.device, setting.half))


@dataclass(frozen=True)
class Setting:
    """What every row of one run shares.

    ``state`` is ``random`` (the seeded initialisation) or ``trained`` (every row loads ``checkpoint``, a state
    made by :mod:`lit_amp_det.bench.state` in ``state_steps`` steps). ``lr``: the constant learning rate of the
    timed training steps; ``None`` runs the recipe's warm-up schedule from step 0, as a fresh run starts.
    ``drift_steps``: training steps or inference calls on batches that change every step, after every other
    measurement, to see how much memory a row accumulates (``--drift-steps``; 0: none;
    :func:`memory_over_changing_batches`).
    """

    device: str
    model: str
    batch: int
    height: int
    width: int
    num_classes: int
    steps: int
    warmup: int
    compile_warmup: int
    state: str = "random"
    state_steps: int = 0
    checkpoint: str | None = None
    lr: float | None = None
    drift_steps: int = 0
    half: str | None = None  # bf16 | fp16 | fp32: the precision of the rows that change it; None: default_half

    @property
    def size(self) -> str:
        return f"{self.height}x{self.width}"


Column = tuple[str, Callable[[dict[str, Any]], str]]


@dataclass(frozen=True)
class Bench:
    """What distinguishes ``bench train`` from ``bench infer``."""

    kind: str  # train | infer
    doc: str
    rows: tuple[Row, ...]
    run_row: Callable[[int, Setting], dict[str, Any]]  # row index -> measurements, in this process
    ratios: Callable[[dict[str, Any], dict[str, Any]], dict[str, float | None]]  # (row, base) -> ratios
    columns: tuple[Column, ...]  # table columns after "# | row | adds"
    panels: tuple[tuple[str, str], ...]  # (ratio key, title) per plot panel
    timings: tuple[str, ...] = ("step",)  # prefixes of the ``<prefix>_ms_*`` timings a row reports
    flop_timing: str = "step"  # the timing whose call ``gflop_per_step`` counts (and images_per_s is from)


# --------------------------------------------------------------------------------------------- config

#: ``--precision`` of ``bench train|infer``: the half precision of the rows that change precision
HALF_CHOICES: tuple[str, ...] = ("auto", "bf16", "fp16", "fp32")


def default_half(device: str) -> str:
    """What ``--precision auto`` means: the dtype of ``trainer.precision=auto`` on ``device`` (fp16 on CUDA, bf16 on a
    CPU that computes bf16 natively, fp32 on any other CPU; :func:`~lit_amp_det.precision.hardware.auto_precision`)."""
    return compute_dtype(auto_precision(device))


def resolve_half(device: str, half: str | None) -> str:
    """``half``, or :func:`default_half` of ``device`` where it is unset (``None``) or ``auto``."""
    return default_half(device) if half in (None, "auto") else str(half)


def mixed_precision(device: str, half: str | None = None) -> str:
    """The ``trainer.precision`` of the autocast rows: ``16-mixed`` for fp16, ``bf16-mixed`` for bf16, ``32-true``
    for fp32; ``half`` ``None``/``auto`` is :func:`default_half`."""
    return {"fp16": "16-mixed", "bf16": "bf16-mixed", "fp32": "32-true"}[resolve_half(device, half)]


def low_precision_weights(device: str, half: str | None = None) -> str:
    """The low-precision-weights twin of :func:`mixed_precision` (``32-true`` stays ``32-true``)."""
    return mixed_precision(device, half).replace("-mixed", "-weights")


def setting_half(setting: Setting) -> str:
    """The half precision of ``setting``'s precision rows (:func:`resolve_half`)."""
    return resolve_half(setting.device, setting.half)


def half_overrides(setting: Setting) -> list[str]:
    """fp16 rows on a CPU run fp16 as asked (the plugin's CPU fallback would run them as bf16 or fp32)."""
    return ["precision.fp16_on_cpu=true"] if setting_half(setting) == "fp16" and setting.device == "cpu" else []


def device_defaults(device: str) -> dict[str, Any]:
    """R50-FPN at COCO size on CUDA; on a CPU the light model (ResNet-18 FPN) at 224 px, a few minutes in all."""
    if device == "cuda":
        return {"model": "maskrcnn_r50_fpn", "batch": 8, "size": (800, 1333), "steps": 20, "warmup": 5}
    return {"model": "maskrcnn_light", "batch": 4, "size": (224, 224), "steps": 10, "warmup": 3}


def default_num_classes(model: str) -> int:
    """81 (COCO's) for ``maskrcnn_r50_fpn``; else 7, background plus the shapes data's 6 classes."""
    return 81 if model == "maskrcnn_r50_fpn" else 7


def setting_overrides(setting: Setting) -> list[str]:
    """The overrides every row of every bench shares: device, model, class count, image size, state."""
    # trainer=gpu|cpu: the device's trainer settings (cudnn.benchmark on a GPU); min/max size equal to the
    # image sides: the transform keeps the images at their size; model.checkpoint: the shared state
    overrides = [f"trainer={'gpu' if setting.device == 'cuda' else 'cpu'}", f"model={setting.model}",
                 f"model.num_classes={setting.num_classes}",
                 f"model.transform.min_size={min(setting.height, setting.width)}",
                 f"model.transform.max_size={max(setting.height, setting.width)}"]
    if setting.checkpoint is not None:  # quoted: a path may hold characters Hydra's grammar reads otherwise
        quoted = setting.checkpoint.replace("\\", "\\\\").replace("'", "\\'")
        overrides.append(f"model.checkpoint='{quoted}'")
    return overrides


def baseline_overrides(setting: Setting) -> list[str]:
    """The overrides of the first row of every bench: the setting, then :data:`BASELINE`."""
    return [*setting_overrides(setting), *BASELINE]


def row_overrides(rows: Sequence[Row], index: int, setting: Setting) -> list[str]:
    """The overrides of ``rows[index]``: the setting, :data:`BASELINE`, then one override per row up to it."""
    added = [row.override_on(setting) for row in rows[1: index + 1] if row.override is not None]
    return [*baseline_overrides(setting), *half_overrides(setting), *added]


@dataclass
class Built:
    """A row's module on its device, with its precision plugin and callbacks.

    ``weights_sha256``: the hash of the detector's weights as built (the loaded state, before any callback
    swapped or folded a layer), equal in every row that loaded the same state.
    """

    module: Any  # MaskRCNNModule
    plugin: Any  # lightning Precision
    callbacks: list[Any]
    weights_sha256: str


def build(cfg: DictConfig, device: str, stage: str) -> Built:
    """Module, callbacks and precision plugin of ``cfg`` in the order ``Trainer.fit``/``predict`` sets them up.

    The callbacks' ``setup`` runs first (FreezeNorm's swaps, ConvBNEval's install), then the plugin's
    ``convert_module`` (fp32 regions), then the move to ``device``. The callbacks used here (FreezeNorm,
    ConvBNEval) never touch the trainer argument of their hooks, so ``None`` stands in for it. On CUDA,
    ``trainer.benchmark`` sets ``torch.backends.cudnn.benchmark`` as the Trainer would.
    """
    from hydra.utils import instantiate

    from lit_amp_det.precision import build_precision_plugin
    from lit_amp_det.app.tasks import instantiate_all

    if cfg.trainer.get("benchmark") is not None and device == "cuda":
        torch.backends.cudnn.benchmark = bool(cfg.trainer.benchmark)  # what the Trainer sets from trainer.benchmark
    torch.manual_seed(0)  # the random state's weights; model.checkpoint, when set, replaces them all
    module = instantiate(cfg.model, _convert_="all")
    loaded = weights_sha256(module.model)
    callbacks = instantiate_all(cfg.get("callbacks"))
    for callback in callbacks:
        callback.setup(None, module, stage)
    options = OmegaConf.to_container(cfg.get("precision") or {}, resolve=True)
    plugin = build_precision_plugin(str(cfg.trainer.precision), "gpu" if device == "cuda" else "cpu", **options)
    plugin.convert_module(module)
    module.to(device)
    return Built(module, plugin, callbacks, loaded)


def switches(cfg: DictConfig, built: Built) -> dict[str, Any]:
    """The values of the switches the rows turn on, as this row's process built them."""
    return {
        "trainer.precision": getattr(built.plugin, "precision", str(cfg.trainer.precision)),
        "precision.fp32_regions": OmegaConf.to_container(cfg.precision, resolve=True).get("fp32_regions"),
        "model.ops": cfg.model.ops,
        "model.channels_last": cfg.model.channels_last,
        "model.deconv_as_matmul": cfg.model.deconv_as_matmul,
        "precision.fused_master_step": cfg.precision.get("fused_master_step"),
        "model.labelled_mask_logits": cfg.model.labelled_mask_logits,
        "model.pointwise_conv_as_matmul": cfg.model.pointwise_conv_as_matmul,
        "model.winograd_convs": list(cfg.model.winograd_convs),
        "model.winograd_output_tile": cfg.model.winograd_output_tile,
        "model.winograd_weight_tile_cache": cfg.model.winograd_weight_tile_cache,
        "model.compile": cfg.model.compile,
        "callbacks": [repr(c) for c in built.callbacks],
        "optim.optimizer.fused": cfg.optim.optimizer.get("fused"),
    }


# -------------------------------------------------------------------------------------------- measuring

def synthetic_batch(setting: Setting, batch: int) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    """The timed batch: the first ``batch`` images of the shapes data's ``val`` split at the setting's size.

    ``uint8`` images as the loaders deliver them, with their shapes' boxes, labels and masks. Not the images
    the state was trained on (those are ``train`` images), and the same in every row and repeat.
    """
    return shapes_batch("val", range(batch), setting.height, setting.width, setting.num_classes, setting.device)


def summarise(times: Sequence[float], prefix: str = "step") -> dict[str, Any]:
    """Median, quartiles, IQR, min and max of ``times`` (seconds), in ms."""
    ms = sorted(1000 * t for t in times)
    q1, q3 = statistics.quantiles(ms, n=4, method="inclusive")[0::2] if len(ms) > 1 else (ms[0], ms[0])
    return {f"{prefix}_ms_median": statistics.median(ms), f"{prefix}_ms_q1": q1, f"{prefix}_ms_q3": q3,
            f"{prefix}_ms_iqr": q3 - q1, f"{prefix}_ms_min": ms[0], f"{prefix}_ms_max": ms[-1],
            f"{prefix}_ms_all": [1000 * t for t in times]}


def memory_ratio(row: dict[str, Any], base: dict[str, Any]) -> float | None:
    """A row's peak memory over the base row's; None where the base needed none (a CPU step on warm pages)."""
    return row["peak_memory_mb"] / base["peak_memory_mb"] if base["peak_memory_mb"] > 0 else None


class PeakMemory:
    """Peak memory of one step, measured after the timed ones, above what the process held right after building the
    model (MB).

    Measured with :class:`~lit_amp_det.profiling.MemoryProbe`, as ``MemoryMonitor`` and ``RunStats`` measure
    ``fit``: the CUDA allocator's peak, or on a CPU the process's ``VmHWM`` (``ru_maxrss`` where it cannot be reset).
    On a CPU the step runs last, after glibc's mmap threshold is pinned and its freed heap handed back
    (:func:`~lit_amp_det.profiling.pin_malloc_threshold`): otherwise the resident peak of the timed steps includes
    whatever heap the allocator kept from earlier steps, which depends on the order of the allocations, not on what
    the step holds. Measured on the R50-FPN at 256 px: two variants that hold the same tensors (577 vs 573 MB
    pinned) read 704-732 vs 630-657 MB unpinned. A row that keeps its freed heap on purpose
    (:class:`~lit_amp_det.callbacks.retain_cpu_heap.RetainCPUHeap`) is measured as it runs, unpinned and untrimmed,
    right after the timed steps (:attr:`measures_the_kept_heap`): the heap its training keeps is memory the process
    holds, the heap the bench's own instrumented steps would add is not.
    """

    def __init__(self, device: str) -> None:
        self.probe = MemoryProbe(device)
        self.baseline = self.probe.baseline_bytes() / MB
        pinned = "" if self.probe.cuda else (", glibc's mmap threshold pinned and freed heap released first (a row "
                                             "that retains its CPU heap: as it runs, right after the timed steps, "
                                             "the kept heap included)")
        self.method = (f"{self.probe.source}, one step after the timed ones{pinned}, minus what was in use after "
                       "building")

    @property
    def measures_the_kept_heap(self) -> bool:
        """True for a CPU row that keeps its freed heap (:func:`~lit_amp_det.cpu_heap.retains_freed_memory`): its
        peak is what the process holds, so it depends on what ran before. Such a row measures its peak step right
        after the timed ones, before the bench's instrumented steps (the FLOP count under
        ``FlopCounterMode``, the direct-convolution count, the profiled step): each of those allocates in its own
        pattern, and on the R50-FPN at 256 px one of them grew the kept heap by about 50 MB that no training step
        needs (BENCHMARKS.md, the section on "the kept heap measured before the instrumented steps")."""
        return not self.probe.cuda and retains_freed_memory()

    def peak_of(self, run: Callable[[], Any]) -> dict[str, float]:
        """Runs ``run`` once and returns its peak (see the class doc). On a CPU the pinned threshold is lifted again
        afterwards (every large allocation would fault in fresh pages while it holds); call it after the timed work
        all the same, since glibc's own adjustment of the threshold stays off."""
        pin = not self.probe.cuda and not retains_freed_memory()
        if pin:
            pin_malloc_threshold()
            release_freed_cpu_memory()
        try:
            self.probe.synchronize()
            self.probe.reset_peak()
            run()
            self.probe.synchronize()
        finally:
            if pin:
                unpin_malloc_threshold()
        return self.peak()

    def peak(self) -> dict[str, float]:
        """``peak_memory_mb`` (above the built model) and ``peak_memory_abs_mb`` (the whole process/device)."""
        absolute = self.probe.peak_bytes() / MB
        return {"peak_memory_mb": absolute - self.baseline, "peak_memory_abs_mb": absolute}


def memory_over_changing_batches(step: Callable[[int, Any], None], setting: Setting, split: str) -> dict[str, Any]:
    """``setting.drift_steps`` more steps (training steps or inference calls), step k on images ``k * batch ...`` of
    the shapes data's ``split``: new shapes, RoI and detection counts every step, as in real use, where the timed
    steps repeat one batch. ``step(k, (images, targets))`` runs one.

    Returns how much the heap in use (live ``malloc`` blocks) and the resident set grew over all of them and over
    their second half, in MB (``{}`` for 0 steps; heap figures None without glibc): memory a row keeps per new shape
    (oneDNN's per-shape matmul primitives, before :mod:`lit_amp_det.models.bounded_matmul`) shows as a heap that
    still grows in the second half."""
    steps = setting.drift_steps
    if steps <= 0:
        return {}

    def sample() -> tuple[int | None, int | None]:
        return heap_in_use_bytes(), resident_bytes()

    def growth(before: int | None, after: int | None) -> float | None:
        return None if before is None or after is None else (after - before) / MB

    start = middle = sample()  # middle: after the first half (one step: the start)
    for k in range(steps):
        batch = shapes_batch(split, range(k * setting.batch, (k + 1) * setting.batch), setting.height,
                             setting.width, setting.num_classes, setting.device)
        step(k, batch)
        if k + 1 == steps // 2:
            middle = sample()
    end = sample()
    return {"drift_steps": steps,
            "drift_heap_growth_mb": growth(start[0], end[0]),
            "drift_heap_growth_late_mb": growth(middle[0], end[0]),
            "drift_resident_growth_mb": growth(start[1], end[1]),
            "drift_resident_growth_late_mb": growth(middle[1], end[1])}


def drift_text(row: dict[str, Any]) -> str:
    """Heap in use / resident set growth over the changing batches (second half in brackets), or - if not run."""
    if not row.get("drift_steps"):
        return "-"

    def mb(key: str) -> str:
        value = row.get(key)
        return "?" if value is None else f"{value:+.0f}"

    return (f"{mb('drift_heap_growth_mb')} ({mb('drift_heap_growth_late_mb')}) / "
            f"{mb('drift_resident_growth_mb')} ({mb('drift_resident_growth_late_mb')}) in {row['drift_steps']}")


#: The table column of :func:`memory_over_changing_batches`' figures.
DRIFT_COLUMN: Column = (
    "changing batches: heap / RSS growth MB (late half)", drift_text)

"""The rows of ``bench train``, ``bench infer`` and ``bench precision``: what each row switches on, as Hydra
overrides.

A row is the list of overrides that ``fit`` or ``predict`` would be given. Every bench starts from
:data:`BASELINE`. In ``train`` and ``infer`` each later row adds one switch to the row above (rows are
cumulative), so the ratio to the row above is that switch's gain (a row that must undo a switch above says so
in its label); on a CPU the rows that only run on CUDA add nothing to the rows below them. In ``precision``
each row is the baseline plus its own precision settings. Every row of a run shares one :class:`Setting`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lit_amp_det.app.config import compose  # re-exported: the benches compose rows as the CLI does
from lit_amp_det.precision.hardware import auto_precision

__all__ = [
    "BASELINE",
    "BENCHES",
    "HALF_CHOICES",
    "PAD_INSTANCES",
    "Bench",
    "Row",
    "Setting",
    "compose",
    "default_rows",
    "device_defaults",
    "resolve_half",
    "row_adds",
    "row_overrides",
]

#: Overrides of the first row of every bench: torchvision's model as built, fp32, no callbacks, SGD (the
#: recipe of ``conf/optim/sgd.yaml``) on PyTorch's default (foreach) kernel. ``precision.fp32_regions={}``
#: changes nothing in fp32; it makes the autocast row plain ``torch.autocast``, so that the next row adds the
#: fp32 regions alone.
BASELINE = (
    "speedups=none",
    "callbacks=none",
    "trainer.precision=32-true",
    "optim=sgd",
    "optim.optimizer.fused=null",
    "precision.fp32_regions={}",
)

#: ``--precision`` of ``bench train|infer``: the half precision of the rows that change precision.
HALF_CHOICES = ("auto", "bf16", "fp16", "fp32")


def _speedup(name: str, transform: str, devices: str = "") -> str:
    """The override that adds one transform of :mod:`lit_amp_det.models.speedups` to ``speedups=none``."""
    return f"+speedups.{name}={{_target_:lit_amp_det.models.speedups.{transform}{devices}}}"


@dataclass(frozen=True)
class Row:
    """One row: ``adds`` are its overrides on top of the row above (cumulative benches) or of
    :data:`BASELINE`, where ``{mixed}`` stands for the run's autocast precision (``16-mixed``, ``bf16-mixed``,
    or ``32-true`` when the run's half precision is fp32) and ``{weights}`` for its low-precision-weights
    twin. ``when`` says which runs include the row unless ``--rows`` names it: ``always``; ``half``, not when
    the half precision is fp32 (the row would change nothing); ``cuda``, not on a CPU (fp16 there is emulated
    and slow).
    """

    name: str
    label: str
    adds: tuple[str, ...] = ()
    when: str = "always"


@dataclass(frozen=True)
class Bench:
    """The benches differ in ``stage``, ``fit`` (training steps) or ``predict`` (inference calls), and
    ``timings``, a row's timed series (``step``; ``latency`` at batch 1, ``batch`` at the bench batch), the
    last giving images/s.
    """

    kind: str
    stage: str
    rows: tuple[Row, ...]
    cumulative: bool
    timings: tuple[str, ...]


_FIRST_ROWS = (
    Row("torchvision-fp32", "torchvision fp32 eager"),
    Row("autocast", "+ torch.autocast", ("trainer.precision={mixed}",), "half"),
    Row("fp32-regions", "+ precision plugin (fp32 regions)", ("precision.fp32_regions=null",), "half"),
    Row("ext-ops", "+ lit_amp_det ops", (_speedup("ext_ops", "ExtensionOps"),)),
    Row("channels-last", "+ channels_last", (_speedup("channels_last", "ChannelsLast"),)),
)
# on every device, so that a CPU run measures it too; the compile row after it then compiles the whole
# detector
_SYNC_FREE = Row(
    "sync-free", "+ sync_free (fixed shapes)", (_speedup("sync_free", "SyncFree", ",devices:[cpu,cuda]"),)
)
#: Padded training targets: every image's instance count (so the step's shapes) stays the same from batch to
#: batch, as the CUDA graph replays it; the bench pads its batch as the data module pads a training batch.
PAD_INSTANCES = "data.pad_instances=100"
# training: the fixed-shape step as the step-graph row below replays it, so that the graph's ratio to this row
# is the graph's gain alone: padded targets, and autocast ({mixed}) again, which a CUDA graph holds and half
# weights (the low-precision-weights row above) it does not. Its ratio to that row is sync_free's gain less
# the half weights'; to the fused-optim row (in the same precision) it is sync_free's gain.
_SYNC_FREE_TRAIN = Row(
    "sync-free",
    "+ sync_free (fixed shapes, padded targets; autocast weights again)",
    (*_SYNC_FREE.adds, "trainer.precision={mixed}", PAD_INSTANCES),
)
_COMPILE = Row("compile", "+ torch.compile (whole if sync_free)", (_speedup("compile", "CompileBackbone"),))
# training: the whole step (forward, backward, optimizer) replayed as one CUDA graph (callbacks.cuda_graph),
# before compile so that the compile row's kernels are captured too; inference: inductor's CUDA graphs of the
# compiled forward
_STEP_GRAPH = Row(
    "step-graph",
    "+ whole step as one CUDA graph",
    ("callbacks=[freeze_norm,conv_bn_eval,cuda_graph]",),
    "cuda",
)
_CUDA_GRAPHS = Row(
    "cuda-graphs", "+ CUDA graphs (reduce-overhead)", ("+speedups.compile.mode=reduce-overhead",), "cuda"
)

TRAIN_ROWS = (
    *_FIRST_ROWS,
    Row("freeze-norm-convbn", "+ FreezeNorm + ConvBNEval", ("callbacks=[freeze_norm,conv_bn_eval]",)),
    Row("fused-optim", "+ fused SGD", ("optim.optimizer.fused=auto",)),
    Row("low-precision-weights", "+ half weights, fp32 masters", ("trainer.precision={weights}",), "half"),
    _SYNC_FREE_TRAIN,
    _STEP_GRAPH,
    _COMPILE,
)
INFER_ROWS = (
    *_FIRST_ROWS,
    Row(
        "binary-mask-paste", "+ masks pasted as booleans", (_speedup("binary_mask_paste", "BinaryMaskPaste"),)
    ),
    Row("convbn-eval", "+ ConvBNEval (fold on the fly)", ("callbacks=[conv_bn_eval]",)),
    Row("convbn-fold", "+ conv-BN folded once", ("callbacks.conv_bn_eval.fold_on_predict=true",)),
    _SYNC_FREE,
    _COMPILE,
    _CUDA_GRAPHS,
)
_FP16_ON_CPU = "precision.fp16_on_cpu=true"  # a no-op on CUDA; on a CPU fp16 as named, not its bf16 twin
_REGIONS = "precision.fp32_regions=null"  # the precision plugin's fp32 regions (its default)
PRECISION_ROWS = (
    Row("32-true", "32-true"),
    Row("bf16-mixed", "bf16-mixed, fp32 regions", ("trainer.precision=bf16-mixed", _REGIONS)),
    Row("bf16-mixed-plain", "bf16-mixed, plain autocast", ("trainer.precision=bf16-mixed",)),
    Row("16-mixed", "16-mixed, fp32 regions", ("trainer.precision=16-mixed", _REGIONS, _FP16_ON_CPU), "cuda"),
    Row("16-mixed-plain", "16-mixed, plain autocast", ("trainer.precision=16-mixed", _FP16_ON_CPU), "cuda"),
    Row("bf16-weights", "bf16 weights, fp32 masters", ("trainer.precision=bf16-weights", _REGIONS)),
    Row(
        "16-weights",
        "fp16 weights, fp32 masters",
        ("trainer.precision=16-weights", _REGIONS, _FP16_ON_CPU),
        "cuda",
    ),
)

BENCHES = {
    "train": Bench("train", "fit", TRAIN_ROWS, cumulative=True, timings=("step",)),
    "infer": Bench("infer", "predict", INFER_ROWS, cumulative=True, timings=("latency", "batch")),
    "precision": Bench("precision", "fit", PRECISION_ROWS, cumulative=False, timings=("step",)),
}


@dataclass(frozen=True)
class Setting:
    """What every row of one run shares. ``weights``: the state file every row loads (``model.weights``), or
    None for the seeded initialisation. ``lr``: the constant learning rate of the timed training steps (the
    state's final one); None runs the recipe's warm-up schedule from step 0, as a fresh run starts. ``half``:
    ``bf16``, ``fp16`` or ``fp32``, the precision of the rows that change it; None or ``auto`` is
    ``trainer.precision=auto``'s choice.
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
    weights: str | None = None
    lr: float | None = None
    half: str | None = None

    @property
    def size(self) -> str:
        return f"{self.height}x{self.width}"


def resolve_half(setting: Setting) -> str:
    """The rows' half precision: ``setting.half``, or what ``trainer.precision=auto`` computes in on the
    device.
    """
    if setting.half not in (None, "auto"):
        return str(setting.half)
    return {"16-mixed": "fp16", "bf16-mixed": "bf16", "32-true": "fp32"}[auto_precision(setting.device)]


def row_adds(row: Row, setting: Setting) -> list[str]:
    """``row.adds`` with ``{mixed}`` and ``{weights}`` filled in for ``setting``."""
    mixed = {"fp16": "16-mixed", "bf16": "bf16-mixed", "fp32": "32-true"}[resolve_half(setting)]
    return [
        add.replace("{mixed}", mixed).replace("{weights}", mixed.replace("-mixed", "-weights"))
        for add in row.adds
    ]


def device_defaults(device: str) -> dict[str, Any]:
    """R50-FPN at COCO size on CUDA; on a CPU the light model (ResNet-18 FPN) at 224 px."""
    if device == "cuda":
        return {"model": "maskrcnn_r50_fpn", "batch": 8, "size": (800, 1333), "steps": 20, "warmup": 5}
    return {"model": "maskrcnn_light", "batch": 4, "size": (224, 224), "steps": 10, "warmup": 3}


def row_overrides(bench: Bench, index: int, setting: Setting) -> list[str]:
    """The overrides of ``bench.rows[index]``: the setting's (the device's trainer, the model and its input
    size, the state), :data:`BASELINE`, the timing lr, then the row's own (in a cumulative bench, those of
    every row up to it but the CUDA rows above it on a CPU: a switch that cannot run there would stop every
    row below it).
    """
    # min/max size equal to the image sides: the transform keeps the images at their size
    overrides = [
        f"trainer={'gpu' if setting.device == 'cuda' else 'cpu'}",
        f"model={setting.model}",
        f"model.num_classes={setting.num_classes}",
        f"model.transform.min_size={min(setting.height, setting.width)}",
        f"model.transform.max_size={max(setting.height, setting.width)}",
    ]
    if setting.weights is not None:  # quoted: a path may hold characters Hydra's grammar reads otherwise
        quoted = setting.weights.replace("\\", "\\\\").replace("'", "\\'")
        overrides.append(f"model.weights='{quoted}'")
    if bench.cumulative:
        above = [row for row in bench.rows[1:index] if row.when != "cuda" or setting.device == "cuda"]
        rows = [*above, bench.rows[index]] if index > 0 else []
    else:
        rows = [bench.rows[index]]
    lr = [] if setting.lr is None else [f"optim.optimizer.lr={setting.lr!r}", "optim.scheduler=null"]
    half = (
        [_FP16_ON_CPU]
        if resolve_half(setting) == "fp16" and setting.device == "cpu" and bench.cumulative
        else []
    )
    return [*overrides, *BASELINE, *lr, *half, *(add for row in rows for add in row_adds(row, setting))]


def default_rows(bench: Bench, setting: Setting) -> list[str]:
    """The rows a run includes unless ``--rows`` names others (see :attr:`Row.when`)."""
    skipped = {"half": resolve_half(setting) == "fp32", "cuda": setting.device == "cpu"}
    return [row.name for row in bench.rows if not skipped.get(row.when)]

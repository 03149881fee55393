"""Shared machinery of ``bench train`` and ``bench infer``: lit_amp_det's optimisations added one at a time.

A row is a list of Hydra overrides. The first row switches every optimisation off (torchvision's own ops,
fp32, no callbacks, SGD without the fused kernel, eager, NCHW); every later row is the previous row's list
plus exactly one override that switches one optimisation on (Hydra applies overrides in order, the last
value of a key wins). A row's config is composed from the real tree and built the way ``fit``/``predict``
build it: :class:`~lit_amp_det.MaskRCNNModule` from ``cfg.model`` (which applies ``model.ops``,
``model.channels_last`` and ``model.compile``), the callbacks of ``cfg.callbacks`` with the hooks the
Trainer would call, the precision plugin from ``trainer.precision`` and ``cfg.precision`` (the plugin with
``fp32_regions: {}`` is plain ``torch.autocast``, plus a GradScaler for ``16-mixed``), and the optimizer
and schedule from the module's hyper-parameters, as ``configure_optimizers`` builds them.

Every row runs in its own process (memory the allocators keep, compiled code and installed wrappers must
not leak into the next row) on the same seeded synthetic batches, with ``trainer=gpu`` or ``trainer=cpu``
for the device; warm-up steps are excluded and CUDA is synchronised around every timed step. The table
gives medians with the interquartile range (IQR) of the timed steps as the spread. Peak memory is what the
timed steps needed above the built model and its batch (so gradients, optimizer state and activations):
CUDA ``max_memory_allocated``, reset after warm-up, minus ``memory_allocated`` after building; on a
CPU the resident-set high-water mark ``VmHWM`` (reset after warm-up through ``/proc/self/clear_refs``)
minus the resident set right after building. glibc keeps freed memory, so on a CPU the figure is an upper
bound and, for the compile rows, also holds what the compiler left resident. A row whose process fails
becomes a ``failed`` row with the error's last line; the others are still reported. Results go to
``bench_<kind>.md``, ``bench_<kind>.json`` and ``bench_<kind>.png`` in the run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

__all__ = [
    "BASELINE",
    "Bench",
    "Built",
    "Column",
    "PeakMemory",
    "Row",
    "Setting",
    "build",
    "compose_row",
    "device_defaults",
    "environment",
    "main",
    "mixed_precision",
    "parse_size",
    "plot",
    "ratio_text",
    "row_overrides",
    "run_row_process",
    "summarise",
    "switches",
    "synthetic_batch",
    "table",
    "timed",
    "write_report",
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
    "model.compile=null",
)

#: Marks the one stdout line of a row process that carries its result.
_MARKER = "BENCH_ROW "


@dataclass(frozen=True)
class Row:
    """One row: ``override`` (``None`` for the baseline row) switches one optimisation on.

    ``{mixed}`` in the override stands for the device's mixed precision (see :func:`mixed_precision`).
    """

    name: str
    label: str
    override: str | None


@dataclass(frozen=True)
class Setting:
    """What every row of one run shares."""

    device: str
    model: str
    batch: int
    height: int
    width: int
    num_classes: int
    steps: int
    warmup: int
    compile_warmup: int

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


# --------------------------------------------------------------------------------------------- config

def mixed_precision(device: str) -> str:
    """``16-mixed`` on CUDA (fp16 tensor cores, GradScaler); ``bf16-mixed`` on a CPU."""
    return "16-mixed" if device == "cuda" else "bf16-mixed"


def device_defaults(device: str) -> dict[str, Any]:
    """R50-FPN at COCO size on CUDA; on a CPU the light model (ResNet-18 FPN) at 224 px, a few minutes in all."""
    if device == "cuda":
        return {"model": "maskrcnn_r50_fpn", "batch": 8, "size": (800, 1333), "steps": 20, "warmup": 5}
    return {"model": "maskrcnn_light", "batch": 4, "size": (224, 224), "steps": 10, "warmup": 3}


def _setting_overrides(setting: Setting) -> list[str]:
    # trainer=gpu|cpu: the device's trainer settings (cudnn.benchmark on a GPU); min/max size equal to the
    # image sides: the transform keeps the synthetic images at their size
    return [f"trainer={'gpu' if setting.device == 'cuda' else 'cpu'}", f"model={setting.model}",
            f"model.num_classes={setting.num_classes}",
            f"model.transform.min_size={min(setting.height, setting.width)}",
            f"model.transform.max_size={max(setting.height, setting.width)}"]


def row_overrides(rows: Sequence[Row], index: int, setting: Setting) -> list[str]:
    """The overrides of ``rows[index]``: the setting, :data:`BASELINE`, then one override per row up to it."""
    added = [row.override.format(mixed=mixed_precision(setting.device)) for row in rows[1: index + 1]
             if row.override is not None]
    return [*_setting_overrides(setting), *BASELINE, *added]


def compose_row(overrides: Sequence[str]) -> DictConfig:
    """``conf/config.yaml`` composed with ``overrides``, as the CLI composes it (no Hydra run)."""
    from hydra import compose, initialize_config_dir

    from lit_amp_det.config import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@dataclass
class Built:
    """A row's module on its device, with its precision plugin and callbacks."""

    module: Any  # MaskRCNNModule
    plugin: Any  # lightning Precision
    callbacks: list[Any]


def build(cfg: DictConfig, device: str, stage: str) -> Built:
    """Module, callbacks and precision plugin of ``cfg`` in the order ``Trainer.fit``/``predict`` sets them up.

    The callbacks' ``setup`` runs first (FreezeNorm's swaps, ConvBNEval's install), then the plugin's
    ``convert_module`` (fp32 regions), then the move to ``device``. The callbacks used here (FreezeNorm,
    ConvBNEval) never touch the trainer argument of their hooks, so ``None`` stands in for it. On CUDA,
    ``trainer.benchmark`` sets ``torch.backends.cudnn.benchmark`` as the Trainer would.
    """
    from hydra.utils import instantiate

    from lit_amp_det.precision import build_precision_plugin
    from lit_amp_det.tasks import _instantiate_all

    if cfg.trainer.get("benchmark") is not None and device == "cuda":
        torch.backends.cudnn.benchmark = bool(cfg.trainer.benchmark)  # what the Trainer sets from trainer.benchmark
    torch.manual_seed(0)
    module = instantiate(cfg.model, _convert_="all")
    callbacks = _instantiate_all(cfg.get("callbacks"))
    for callback in callbacks:
        callback.setup(None, module, stage)
    options = OmegaConf.to_container(cfg.get("precision") or {}, resolve=True)
    plugin = build_precision_plugin(str(cfg.trainer.precision), "gpu" if device == "cuda" else "cpu", **options)
    plugin.convert_module(module)
    module.to(device)
    return Built(module, plugin, callbacks)


def switches(cfg: DictConfig, built: Built) -> dict[str, Any]:
    """The values of the switches the rows turn on, as this row's process built them."""
    return {
        "trainer.precision": getattr(built.plugin, "precision", str(cfg.trainer.precision)),
        "precision.fp32_regions": OmegaConf.to_container(cfg.precision, resolve=True).get("fp32_regions"),
        "model.ops": cfg.model.ops,
        "model.channels_last": cfg.model.channels_last,
        "model.compile": cfg.model.compile,
        "callbacks": [repr(c) for c in built.callbacks],
        "optim.optimizer.fused": cfg.optim.optimizer.get("fused"),
    }


# -------------------------------------------------------------------------------------------- measuring

def synthetic_batch(setting: Setting, batch: int) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    """``batch`` seeded ``uint8`` images (as the loaders deliver them) with 3 boxes and masks each."""
    from lit_amp_det.bench.convbn import _detection_batch

    images, targets = _detection_batch(batch, setting.height, setting.width, setting.device)
    return [(image * 255).to(torch.uint8) for image in images], targets


def timed(fn: Callable[[], Any], device: str) -> float:
    """Seconds ``fn()`` took, CUDA synchronised before and after."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def summarise(times: Sequence[float], prefix: str = "step") -> dict[str, Any]:
    """Median, quartiles, IQR, min and max of ``times`` (seconds), in ms."""
    ms = sorted(1000 * t for t in times)
    q1, q3 = statistics.quantiles(ms, n=4, method="inclusive")[0::2] if len(ms) > 1 else (ms[0], ms[0])
    return {f"{prefix}_ms_median": statistics.median(ms), f"{prefix}_ms_q1": q1, f"{prefix}_ms_q3": q3,
            f"{prefix}_ms_iqr": q3 - q1, f"{prefix}_ms_min": ms[0], f"{prefix}_ms_max": ms[-1],
            f"{prefix}_ms_all": [1000 * t for t in times]}


class PeakMemory:
    """Peak memory of the timed steps above what the process held right after building the model (MB).

    Measured with :class:`~lit_amp_det.callbacks.memory_monitor.MemoryProbe`, as ``MemoryMonitor`` and
    ``RunStats`` measure ``fit``: the CUDA allocator, or the process's ``VmHWM`` (``ru_maxrss`` where it
    cannot be reset, which then includes the warm-up).
    """

    def __init__(self, device: str) -> None:
        from lit_amp_det.callbacks.memory_monitor import MemoryProbe

        self.probe = MemoryProbe(torch.device(device))
        in_use = self.probe.in_use_bytes()
        resettable = self.probe.resettable and in_use is not None
        self.baseline = (in_use if resettable else self.probe.peak_bytes()) / 2**20
        self.method = f"{self.probe.source}, reset after warm-up, minus what was in use after building"
        self.probe.reset_peak()

    def reset(self) -> None:
        """Forget the peaks so far (call after warm-up)."""
        self.probe.synchronize()
        self.probe.reset_peak()

    def peak(self) -> dict[str, float]:
        """``peak_memory_mb`` (above the built model) and ``peak_memory_abs_mb`` (the whole process/device)."""
        absolute = self.probe.peak_bytes() / 2**20
        return {"peak_memory_mb": absolute - self.baseline, "peak_memory_abs_mb": absolute}


# ------------------------------------------------------------------------------------------- reporting

def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict[str, Any]:
    """Device, versions and thread counts, for the report header and the JSON."""
    import lightning
    import torchvision

    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = f"{_cpu_name()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    return {"device": device, "device_name": name, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "torchvision": torchvision.__version__, "lightning": lightning.__version__,
            "cuda": torch.version.cuda if device == "cuda" else None, "python": platform.python_version(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def ratio_text(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """``value`` formatted, or ``-`` when there is none (a failed row, a zero baseline)."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def table(bench: Bench, rows: Sequence[dict[str, Any]], header: Sequence[str]) -> str:
    """The markdown report: ``header`` lines, then one table line per row (failed rows say why)."""
    titles = ["#", "row", "adds override", *(title for title, _ in bench.columns)]
    lines = [*header, "", "| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    for number, row in enumerate(rows, 1):
        cells = [str(number), row["label"], f"`{row['override']}`" if row["override"] else "(baseline)"]
        if row["status"] == "ok":
            cells += [render(row) for _, render in bench.columns]
        else:
            error = row.get("error", "").replace("|", "\\|")
            cells += [f"**failed**: {error}"] + [""] * (len(bench.columns) - 1)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(bench: Bench, rows: Sequence[dict[str, Any]], title: str, path: Path) -> None:
    """Horizontal bars of each ratio in ``bench.panels``, one bar per row (failed rows marked)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, no display needed

    labels = [f"{i}. {row['label']}" for i, row in enumerate(rows, 1)]
    base = next((i for i, row in enumerate(rows) if row["status"] == "ok"), None)
    fig = Figure(figsize=(4.2 * len(bench.panels) + 2.5, 0.42 * len(rows) + 1.6))
    axes = fig.subplots(1, len(bench.panels), sharey=True, squeeze=False)[0]
    for ax, (key, panel_title) in zip(axes, bench.panels):
        values = [row.get(key) if row["status"] == "ok" else None for row in rows]
        ax.barh(range(len(rows)), [v or 0.0 for v in values],
                color=["tab:gray" if i == base else "tab:blue" for i in range(len(rows))])
        ax.axvline(1.0, color="black", linestyle="--", linewidth=0.8)
        for y, value in enumerate(values):
            ax.text(value or 0.0, y, f" {value:.2f}x" if value is not None else " failed / n.a.",
                    va="center", fontsize=8)
        ax.set_title(panel_title, fontsize=9)
        ax.set_yticks(range(len(rows)), labels, fontsize=8)
        ax.set_xlim(0, max([v for v in values if v is not None] + [1.0]) * 1.3)
    axes[0].invert_yaxis()  # row 1 on top, as in the table
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_report(bench: Bench, rows: list[dict[str, Any]], setting: Setting, env: dict[str, Any],
                 command: str, out: Path) -> str:
    """Adds to each ok row its ratios to the first ok row; writes ``bench_<kind>.{md,json,png}`` to ``out``.

    Returns the markdown table.
    """
    base = next((row for row in rows if row["status"] == "ok"), None)
    for row in rows:
        if row["status"] == "ok" and base is not None:
            row.update(bench.ratios(row, base))
    base_label = f"row 1 ({rows[0]['label']})" if rows and base is rows[0] else (
        f"the first row that ran ({base['label']})" if base else "no row (all failed)")
    header = [
        f"# bench {bench.kind}: {env['device_name']}",
        "",
        f"- torch {env['torch']}, torchvision {env['torchvision']}, lightning {env['lightning']}"
        + (f", CUDA {env['cuda']}" if env.get("cuda") else ""),
        f"- model `{setting.model}` ({setting.num_classes} classes), batch {setting.batch}, "
        f"image {setting.size}, {setting.steps} timed steps after {setting.warmup} warm-up "
        f"({setting.compile_warmup} for compile rows)",
        f"- command: `{command}`",
        *_load_line(env),
        f"- ratios vs {base_label}; spread = interquartile range (IQR) of the timed steps; peak = memory the "
        f"timed steps needed above the built model ({_memory_method(rows)})",
    ]
    text = table(bench, rows, header)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_{bench.kind}.md").write_text(text + "\n")
    with open(out / f"bench_{bench.kind}.json", "w") as f:
        json.dump({"kind": bench.kind, "command": command, "setting": asdict(setting), "environment": env,
                   "rows": rows}, f, indent=2)
    plot(bench, rows, f"bench {bench.kind}: {setting.model}, batch {setting.batch}, {setting.size}, "
         f"{env['device_name']}", out / f"bench_{bench.kind}.png")
    return text


def _load_line(env: dict[str, Any]) -> list[str]:
    """The 1-minute load average before and after: other processes on the cores make CPU timings unreliable."""
    if not env.get("load_average"):
        return []
    after = env.get("load_average_after", env["load_average"])
    return [f"- 1-min load average before / after the rows: {env['load_average'][0]:.1f} / {after[0]:.1f} on "
            f"{env['cpu_count']} cores (after includes the rows themselves; other work on the cores skews timings)"]


def _memory_method(rows: Sequence[dict[str, Any]]) -> str:
    return next((row["memory_method"] for row in rows if row.get("memory_method")), "n/a")


# --------------------------------------------------------------------------------------------- driving

def _positive(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def parse_size(text: str) -> tuple[int, int]:
    """``"224"`` (square) or ``"800x1333"`` (height x width) -> ``(height, width)``."""
    parts = text.lower().split("x")
    try:
        sides = [int(p) for p in parts]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2) or min(sides) < 32:
        raise argparse.ArgumentTypeError(f"expected SIDE or HEIGHTxWIDTH in pixels (>= 32), e.g. 224 or 800x1333; "
                                         f"got {text!r}")
    return (sides[0], sides[-1])


def _row_names(rows: Sequence[Row]) -> Callable[[str], list[str]]:
    names = [row.name for row in rows]

    def parse(text: str) -> list[str]:
        chosen = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in names]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"unknown row(s) {unknown or [text]}; choose a comma-separated "
                                             f"subset of {','.join(names)}")
        return [name for name in names if name in chosen]  # table order

    return parse


def _parser(bench: Bench) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m lit_amp_det bench {bench.kind}", description=bench.doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available, else cpu")
    parser.add_argument("--model", help="model config (conf/model/*.yaml); default maskrcnn_r50_fpn on cuda, "
                                        "maskrcnn_light on cpu")
    parser.add_argument("--batch", type=_positive(1), help="images per step (default 8 on cuda, 4 on cpu)")
    parser.add_argument("--size", type=parse_size, help="SIDE or HEIGHTxWIDTH (default 800x1333 on cuda, 224 on cpu)")
    parser.add_argument("--num-classes", type=_positive(2),
                        help="classes incl. background (default 81, COCO's, for maskrcnn_r50_fpn; else 4)")
    parser.add_argument("--steps", type=_positive(1), help="timed steps per row (default 20 on cuda, 10 on cpu)")
    parser.add_argument("--warmup", type=_positive(0), help="untimed steps per row (default 5 on cuda, 3 on cpu)")
    parser.add_argument("--compile-warmup", type=_positive(0),
                        help="untimed steps for rows with model.compile set (default: --warmup + 3)")
    parser.add_argument("--rows", type=_row_names(bench.rows),
                        help=f"comma-separated subset of {','.join(r.name for r in bench.rows)} (default: all); "
                             "a row keeps the overrides of the rows above it whether they run or not")
    parser.add_argument("--out", type=Path, help=f"output directory (default: ${{LIT_AMP_DET_RUNS:-runs}}/bench/"
                                                 f"{bench.kind}/<YYYY-mm-dd_HH-MM-SS>)")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run this one row, print its JSON line
    return parser


def _setting(bench: Bench, args: argparse.Namespace, parser: argparse.ArgumentParser) -> Setting:
    from lit_amp_det.config import config_groups

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine; use --device cpu")
    defaults = device_defaults(device)
    model = args.model or defaults["model"]
    if model not in config_groups()["model"]:
        parser.error(f"--model {model!r}: no conf/model/{model}.yaml; choose one of {config_groups()['model']}")
    height, width = args.size or defaults["size"]
    warmup = defaults["warmup"] if args.warmup is None else args.warmup
    return Setting(device=device, model=model, batch=args.batch or defaults["batch"], height=height, width=width,
                   num_classes=args.num_classes or (81 if model == "maskrcnn_r50_fpn" else 4),
                   steps=args.steps or defaults["steps"], warmup=warmup,
                   compile_warmup=warmup + 3 if args.compile_warmup is None else args.compile_warmup)


def _setting_argv(setting: Setting) -> list[str]:
    return [f"--device={setting.device}", f"--model={setting.model}", f"--batch={setting.batch}",
            f"--size={setting.size}", f"--num-classes={setting.num_classes}", f"--steps={setting.steps}",
            f"--warmup={setting.warmup}", f"--compile-warmup={setting.compile_warmup}"]


def run_row_process(bench: Bench, index: int, setting: Setting) -> dict[str, Any]:
    """Runs ``bench.rows[index]`` in a fresh ``python -m lit_amp_det.bench.<kind> --row=NAME`` process.

    Returns its measurements with ``status: ok``, or ``status: failed`` with the last line of its stderr.
    """
    row = bench.rows[index]
    command = [sys.executable, "-m", f"lit_amp_det.bench.{bench.kind}", f"--row={row.name}", *_setting_argv(setting)]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARKER)]
    if proc.returncode == 0 and lines:
        return {**json.loads(lines[-1][len(_MARKER):]), "status": "ok", "wall_s": wall}
    errors = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    error = errors[-1] if errors else f"exit status {proc.returncode}, no result line"
    return {"status": "failed", "error": error, "returncode": proc.returncode, "wall_s": wall,
            "stderr_tail": proc.stderr[-4000:]}


def _out_dir(kind: str) -> Path:
    root = Path(os.environ.get("LIT_AMP_DET_RUNS") or "runs") / "bench" / kind
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    out, n = root / stamp, 1
    while out.exists():  # two runs in one second
        out, n = root / f"{stamp}_{n}", n + 1
    return out


def main(bench: Bench, argv: Sequence[str] | None = None) -> None:
    """``bench <kind> [options]``: every selected row in its own process, then the report."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(bench)
    args = parser.parse_args(argv)
    setting = _setting(bench, args, parser)
    names = [row.name for row in bench.rows]
    if args.row is not None:
        if args.row not in names:
            parser.error(f"--row {args.row!r}: choose one of {', '.join(names)}")
        index = names.index(args.row)
        result = bench.run_row(index, setting)
        print(_MARKER + json.dumps({"name": args.row, **result}), flush=True)
        return
    selected = args.rows or names
    out = args.out or _out_dir(bench.kind)
    command = shlex.join(["python", "-m", "lit_amp_det", "bench", bench.kind, *argv])
    env = environment(setting.device)  # the load average before the rows run
    rows = []
    for number, name in enumerate(selected, 1):
        index = names.index(name)
        row = bench.rows[index]
        print(f"[{number}/{len(selected)}] {row.label} ...", end=" ", flush=True, file=sys.stderr)
        result = run_row_process(bench, index, setting)
        print(f"{result['status']} ({result['wall_s']:.0f} s)", flush=True, file=sys.stderr)
        rows.append({"name": name, "label": row.label,
                     "override": row.override.format(mixed=mixed_precision(setting.device)) if row.override else None,
                     "overrides": row_overrides(bench.rows, index, setting), **result})
    if hasattr(os, "getloadavg"):
        env["load_average_after"] = list(os.getloadavg())
    text = write_report(bench, rows, setting, env, command, out)
    print(text)
    print(f"\nwritten to {out}/bench_{bench.kind}.{{md,json,png}}")

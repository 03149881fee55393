"""``python -m lit_amp_det bench train|infer|precision``: Mask R-CNN speed and memory, one switch per row.

``train`` times training steps as the speedups add up, each row the row above plus one switch: torchvision
fp32 eager (``speedups=none``, no callbacks, ``trainer.precision=32-true``, SGD without its fused kernel), +
autocast (``16-mixed`` on CUDA, ``bf16-mixed`` on a CPU with native bf16; ``--precision``), + the precision
plugin's fp32 regions, + lit_amp_det's NMS/RoIAlign/IoU kernels (``speedups.ext_ops``), + channels_last, + the
FreezeNorm and ConvBNEval callbacks, + the fused optimizer, + low-precision weights with fp32 masters, +
``torch.compile`` of the backbone. ``infer`` times inference calls (latency at batch 1, throughput at
``--batch``) through the same first rows, then + masks pasted as booleans, + ConvBNEval folding on the fly, +
the pairs folded once, + compile. ``precision`` times training steps of torchvision's model in each precision
mode on its own (fp32; bf16 and fp16 autocast with and without the fp32 regions; bf16 and fp16 weights with
fp32 masters; fp16 rows on CUDA unless ``--rows`` names them).

Each row is built as ``fit``/``predict`` build it from its Hydra overrides (listed in the report), loads one
shared model state (``--state``) and times one batch of shapes images. Every repeat of every row runs in a
fresh process (allocator caches, compiled code and hooks must not leak into the next row), or with
``--one-process`` all in this one (the process start, imports and CUDA context paid once: for short runs of
rows that compile nothing), rows interleaved with the order rotated each round; a failed row is reported with
its error and the other rows still are. The report (``bench_<kind>.md`` and ``.json`` in ``--out``) gives per
row images/s, the median step time over repeats and the spread of the repeat medians, the ratios to the first
row and to the row above, peak memory and warm-up time (which holds any compile time).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lit_amp_det.bench import repeats
from lit_amp_det.bench.rows import (
    BENCHES,
    HALF_CHOICES,
    Bench,
    Setting,
    default_rows,
    device_defaults,
    resolve_half,
    row_adds,
    row_overrides,
)
from lit_amp_det.precision.hardware import cpu_capability, cpu_computes_bf16_natively

__all__ = [
    "ONE_PROCESS_REFUSED",
    "device_name",
    "infer",
    "main",
    "parse_size",
    "precision",
    "run_row_here",
    "run_row_process",
    "train",
    "write_report",
]

#: Repeats per row, on a CPU and on CUDA alike: GPU clocks and cudnn.benchmark's choices vary per process too.
DEFAULT_REPEATS = 3
#: Training steps of the trained state: past the SGD recipe's 100 warm-up steps.
DEFAULT_STATE_STEPS = 200
#: Marks the one stdout line of a row process that carries its result.
_MARKER = "BENCH_ROW "
#: Rows ``--one-process`` refuses: what they compile (Dynamo's and Inductor's caches, CUDA graph trees) would
#: stay in the process and change the rows after them.
ONE_PROCESS_REFUSED = ("compile", "cuda-graphs")


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
    try:
        sides = [int(p) for p in text.lower().split("x")]
    except ValueError:
        sides = []
    if len(sides) not in (1, 2) or min(sides) < 32:
        raise argparse.ArgumentTypeError(
            f"expected SIDE or HEIGHTxWIDTH in pixels (>= 32), e.g. 224 or 800x1333; got {text!r}"
        )
    return sides[0], sides[-1]


def _row_names(bench: Bench) -> Callable[[str], list[str]]:
    names = [row.name for row in bench.rows]

    def parse(text: str) -> list[str]:
        chosen = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in chosen if name not in names]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(
                f"unknown row(s) {unknown or [text]}; choose a comma-separated subset of {','.join(names)}"
            )
        return [name for name in names if name in chosen]  # table order

    return parse


def _parser(bench: Bench) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m lit_amp_det bench {bench.kind}",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--device", choices=["cpu", "cuda"], help="default: cuda if available, else cpu")
    add(
        "--model",
        help="model config (conf/model/*.yaml); default maskrcnn_r50_fpn on cuda, maskrcnn_light on cpu",
    )
    add("--batch", type=_positive(1), help="images per step (default 8 on cuda, 4 on cpu)")
    add("--size", type=parse_size, help="SIDE or HEIGHTxWIDTH (default 800x1333 on cuda, 224 on cpu)")
    add(
        "--num-classes",
        type=_positive(2),
        help="classes incl. background (default 81, COCO's, for maskrcnn_r50_fpn; "
        "else 7: background and the shapes data's 6)",
    )
    add(
        "--steps",
        type=_positive(1),
        help="timed steps (calls) per row and repeat (default 20 on cuda, 10 on cpu)",
    )
    add("--warmup", type=_positive(0), help="untimed steps before them (default 5 on cuda, 3 on cpu)")
    add(
        "--compile-warmup", type=_positive(0), help="untimed steps of the compile row (default: --warmup + 3)"
    )
    if bench.cumulative:
        add(
            "--precision",
            choices=HALF_CHOICES,
            default="auto",
            help="half precision of the rows that change precision; auto: fp16 on cuda, bf16 on a CPU with "
            "native bf16, fp32 on other CPUs, where the rows that change nothing in fp32 are left out",
        )
    add(
        "--rows",
        type=_row_names(bench),
        help=f"comma-separated subset of {','.join(r.name for r in bench.rows)} "
        "(default: all that apply); in train and infer a row keeps the switches of the rows above it",
    )
    add(
        "--repeats",
        type=_positive(1),
        default=DEFAULT_REPEATS,
        help=f"runs of each row, each in a fresh process, rows interleaved (default {DEFAULT_REPEATS})",
    )
    add(
        "--one-process",
        action="store_true",
        help="run every row and repeat in this process, each built anew from the same state (the imports and "
        "the CUDA context paid once); refused for rows that compile",
    )
    add(
        "--state",
        choices=["trained", "random"],
        default="trained",
        help="model state every row loads: trained (default; --state-steps of the SGD recipe on the shapes "
        "data, made once and cached) or random (the seeded initialisation)",
    )
    add(
        "--state-steps",
        type=_positive(1),
        default=DEFAULT_STATE_STEPS,
        help=f"training steps of the trained state (default {DEFAULT_STATE_STEPS})",
    )
    add(
        "--cache-dir",
        type=Path,
        help="where the state is cached (default: $LIT_AMP_DET_CACHE or "
        "~/.cache/lit_amp_det, as paths.cache_dir)",
    )
    add(
        "--out",
        type=Path,
        help=f"output directory (default ${{LIT_AMP_DET_RUNS:-runs}}/bench/{bench.kind}/<time>)",
    )
    add("--row", help=argparse.SUPPRESS)  # internal: run this one row, print its JSON line
    add("--state-file", help=argparse.SUPPRESS)  # internal: the state the row loads
    add("--timing-lr", type=float, help=argparse.SUPPRESS)  # internal: the timed steps' lr
    return parser


def _setting(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Setting:
    from lit_amp_det.app.config import config_groups

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine; use --device cpu")
    defaults = device_defaults(device)
    model = args.model or defaults["model"]
    if model not in config_groups()["model"]:
        parser.error(
            f"--model {model!r}: no conf/model/{model}.yaml; choose one of {config_groups()['model']}"
        )
    height, width = args.size or defaults["size"]
    warmup = defaults["warmup"] if args.warmup is None else args.warmup
    # COCO's, else the shapes data's 6 + 1
    num_classes = args.num_classes or (81 if model == "maskrcnn_r50_fpn" else 7)
    return Setting(
        device=device,
        model=model,
        batch=args.batch or defaults["batch"],
        height=height,
        width=width,
        num_classes=num_classes,
        steps=args.steps or defaults["steps"],
        warmup=warmup,
        compile_warmup=warmup + 3 if args.compile_warmup is None else args.compile_warmup,
        state=args.state,
        state_steps=args.state_steps if args.state == "trained" else 0,
        weights=args.state_file,
        lr=args.timing_lr,
        half=getattr(args, "precision", None),
    )


def _setting_argv(setting: Setting) -> list[str]:
    """The command-line options that make a row process's :func:`_setting` return ``setting`` again.

    A row process parses its setting back from its argv, so every field it reads is passed, the optional
    ones (the state file, the timing lr, the precision) only where set; the lr as its ``repr`` so that the
    float comes back exactly.
    """
    optional = {
        "state-file": setting.weights,
        "timing-lr": None if setting.lr is None else repr(setting.lr),
        "precision": setting.half,
    }
    return [
        f"--device={setting.device}",
        f"--model={setting.model}",
        f"--batch={setting.batch}",
        f"--size={setting.size}",
        f"--num-classes={setting.num_classes}",
        f"--steps={setting.steps}",
        f"--warmup={setting.warmup}",
        f"--compile-warmup={setting.compile_warmup}",
        f"--state={setting.state}",
        *(f"--{flag}={value}" for flag, value in optional.items() if value is not None),
    ]


def run_row_process(bench: Bench, index: int, setting: Setting) -> dict[str, Any]:
    """Runs ``bench.rows[index]`` in a fresh ``python -m lit_amp_det.bench.e2e <kind> --row=NAME`` process;
    its measurements with ``status: ok``, or ``status: failed`` with the last line of its stderr.
    """
    command = [
        sys.executable,
        "-m",
        "lit_amp_det.bench.e2e",
        bench.kind,
        f"--row={bench.rows[index].name}",
        *_setting_argv(setting),
    ]
    start = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_MARKER)]
    if proc.returncode == 0 and lines:
        return {**json.loads(lines[-1][len(_MARKER) :]), "status": "ok", "wall_s": wall}
    errors = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    return {
        "status": "failed",
        "error": errors[-1] if errors else f"exit status {proc.returncode}, no result line",
        "returncode": proc.returncode,
        "wall_s": wall,
        "stderr_tail": proc.stderr[-4000:],
    }


def run_row_here(bench: Bench, index: int, setting: Setting) -> dict[str, Any]:
    """Runs ``bench.rows[index]`` in this process, after freeing what the row before it left (its objects, the
    CUDA allocator's cached blocks); its measurements with ``status: ok``, or ``status: failed`` with the
    error.

    Args:
        bench: the bench the row belongs to.
        index: the row's index in ``bench.rows``.
        setting: what every row of the run shares.

    Returns:
        What :func:`~lit_amp_det.bench.measure.run_row` measured, with ``status`` and ``wall_s``; or
        ``status``, ``error`` (the exception's type and message) and ``wall_s`` when the row raised.
    """
    from lit_amp_det.bench.measure import run_row

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    start = time.perf_counter()
    try:
        result = run_row(bench, index, setting)
    except Exception as error:  # a row that fails is a table line; the rows after it still run
        return {
            "status": "failed",
            "error": f"{type(error).__name__}: {error}".splitlines()[0],
            "wall_s": time.perf_counter() - start,
        }
    return {**result, "status": "ok", "wall_s": time.perf_counter() - start}


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name with its core and torch thread counts."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    name = platform.processor() or "CPU"
    with contextlib.suppress(OSError, StopIteration):
        name = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    return f"{name} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def _environment(device: str) -> dict[str, Any]:
    import lightning
    import torchvision

    return {
        "device": device,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "lightning": lightning.__version__,
        "cuda": torch.version.cuda if device == "cuda" else None,
        "cpu_capability": cpu_capability(),
        "cpu_native_bf16": cpu_computes_bf16_natively(),
        "python": platform.python_version(),
    }


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _columns(bench: Bench, setting: Setting) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    """The table's columns after ``# | row | adds``: title and how a row's cell reads."""
    unit = "steps" if bench.stage == "fit" else "calls"
    columns = []
    for timing in bench.timings:
        title = {
            "step": "step ms",
            "latency": "latency ms (batch 1)",
            "batch": f"batch ms ({setting.batch})",
        }[timing]
        columns += [
            (title, lambda r, t=timing: f"{r[f'{t}_ms_median']:.1f}"),
            (
                "repeats ms (spread)",
                lambda r, t=timing: (
                    "-"
                    if r["repeats"] < 2
                    else f"{min(r[f'{t}_ms_repeat_medians']):.1f}-"
                    f"{max(r[f'{t}_ms_repeat_medians']):.1f} ({100 * r[f'{t}_ms_repeat_spread']:.0f} %)"
                ),
            ),
        ]
    return [
        *columns,
        ("images/s", lambda r: f"{r['images_per_s']:.2f}"),
        ("vs row 1", lambda r: _ratio(r.get("speedup"))),
        ("vs row above", lambda r: _ratio(r.get("vs_above"))),
        ("peak MB", lambda r: f"{r['peak_memory_mb']:.0f}"),
        ("memory vs row 1", lambda r: _ratio(r.get("memory_ratio"))),
        ("host syncs", lambda r: str(r.get("host_syncs_per_step", "-"))),
        ("warm-up s", lambda r: f"{r['warmup_s']:.1f} ({r['warmup_steps']} {unit})"),
    ]


def _header(bench: Bench, rows: Sequence[dict[str, Any]], setting: Setting, run: dict[str, Any]) -> list[str]:
    """What every figure depends on besides the row's switches: device, versions, setting, state, repeats."""
    env = run["environment"]
    state = run.get("state")
    lines = [
        f"# bench {bench.kind}: {env['device_name']}",
        "",
        f"- torch {env['torch']}, torchvision {env['torchvision']}, lightning {env['lightning']}"
        + (f", CUDA {env['cuda']}" if env["cuda"] else f", CPU capability {env['cpu_capability']}"),
        f"- model `{setting.model}` ({setting.num_classes} classes), batch {setting.batch}, "
        f"image {setting.size}, {setting.steps} timed steps after {setting.warmup} warm-up "
        f"({setting.compile_warmup} for compile)",
        f"- command: `{run['command']}`",
    ]
    if bench.cumulative:
        lines.append(
            f"- precision rows in {resolve_half(setting)} (`--precision`); each row adds its override to "
            "the row above, whether the rows above ran or not"
        )
    if state:
        lines.append(
            f"- model state: trained, `{state['file']}` (weights sha256 {state['weights_sha256'][:12]}): "
            f"{state['recipe']}; loss {state['loss_first']:.2f} -> {state['loss_last']:.2f}; timed steps at "
            f"the constant lr its schedule ended at, {state['final_lr']:.3g}"
        )
    else:
        lines.append(
            "- model state: random (the seeded initialisation); timed steps on the recipe's schedule"
        )
    source = next((row["memory_source"] for row in rows if row.get("memory_source")), "-")
    where = "all in one process" if run.get("one_process") else "each a fresh process"
    return [
        *lines,
        f"- repeats: {run['repeats']} per row, {where}, rows interleaved with the order "
        "rotated every round; times are the median over repeats of each repeat's median, `repeats` the range "
        "of the repeat medians and (max - min) / median",
        f"- peak MB: one more step, above what was in use once the model was built ({source})",
    ]


def write_report(
    bench: Bench, rows: list[dict[str, Any]], setting: Setting, run: dict[str, Any], out: Path
) -> str:
    """Adds to each ok row its ratios to the first ok row and to the ok row above (what its own switch
    changed), writes ``bench_<kind>.md`` and ``.json`` (``run``: command, environment, state, repeats) to
    ``out``; returns the text.
    """
    ok = [row for row in rows if row["status"] == "ok"]
    for above, row in zip([None, *ok], ok):
        row["speedup"] = row["images_per_s"] / ok[0]["images_per_s"]
        base_mb = ok[0]["peak_memory_mb"]
        row["memory_ratio"] = row["peak_memory_mb"] / base_mb if base_mb > 0 else None
        row["vs_above"] = None if above is None else row["images_per_s"] / above["images_per_s"]
    columns = _columns(bench, setting)
    lines = [
        *_header(bench, rows, setting, run),
        "",
        "| # | row | adds | " + " | ".join(t for t, _ in columns) + " |",
        "|---" * (3 + len(columns)) + "|",
    ]
    for number, row in enumerate(rows, 1):
        adds = " ".join(f"`{add}`" for add in row["adds"]) or "(baseline)"
        cells = (
            [render(row) for _, render in columns]
            if row["status"] == "ok"
            else [f"**failed**: {row.get('error', '')}".replace("|", "\\|")] + [""] * (len(columns) - 1)
        )
        lines.append(f"| {number} | {row['label']} | {adds} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_{bench.kind}.md").write_text(text + "\n")
    (out / f"bench_{bench.kind}.json").write_text(
        json.dumps(
            {"kind": bench.kind, "setting": dataclasses.asdict(setting), **run, "rows": rows},
            indent=2,
            default=str,
        )
    )
    return text


def _out_dir(kind: str) -> Path:
    """A directory no earlier run has taken, ``<runs>/bench/<kind>/<start time>`` (``runs`` unless
    ``LIT_AMP_DET_RUNS`` is set), numbered after the time where a run in the same second took it.

    Each run writes its report and its repeats file into its own directory, so that no run adds to or
    overwrites another's.
    """
    root = Path(os.environ.get("LIT_AMP_DET_RUNS") or "runs") / "bench" / kind
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    out = root / stamp
    number = 1
    while out.exists():  # two runs in one second
        out = root / f"{stamp}_{number}"
        number += 1
    return out


def main(kind: str, argv: Sequence[str] | None = None) -> None:
    """``bench <kind> [options]``: every selected row's repeats in their own processes, then the report."""
    from lit_amp_det.bench.measure import run_row
    from lit_amp_det.bench.state import cache_root, ensure_state

    bench = BENCHES[kind]
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser(bench)
    args = parser.parse_args(argv)
    setting = _setting(args, parser)
    names = [row.name for row in bench.rows]
    if args.row is not None:  # a row process
        if args.row not in names:
            parser.error(f"--row {args.row!r}: choose one of {', '.join(names)}")
        print(
            _MARKER + json.dumps({"name": args.row, **run_row(bench, names.index(args.row), setting)}),
            flush=True,
        )
        return
    selected = args.rows or default_rows(bench, setting)
    if args.one_process and (compiled := [name for name in selected if name in ONE_PROCESS_REFUSED]):
        parser.error(
            f"--one-process: rows {compiled} compile, and what they compile would stay in the process for "
            "the rows after them; leave them out (--rows) or run every row in its own process"
        )
    state = None
    if setting.state == "trained":
        state = ensure_state(setting, setting.state_steps, cache_root(args.cache_dir))
        setting = dataclasses.replace(setting, weights=state["file"], lr=state["final_lr"])
    order = repeats.run_order(len(selected), args.repeats)
    out = args.out or _out_dir(kind)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"bench_{kind}_repeats.jsonl"  # one line per finished repeat: a run cut short keeps them

    def run(number: int, round_: int, position: int) -> dict[str, Any]:
        print(
            f"[{position + 1}/{len(order)}] round {round_ + 1}: {selected[number]} ...",
            end=" ",
            flush=True,
            file=sys.stderr,
        )
        run_one = run_row_here if args.one_process else run_row_process
        result = run_one(bench, names.index(selected[number]), setting)
        timed = [
            f"{t} median {result[f'{t}_ms_median']:.1f} ms"
            for t in bench.timings
            if isinstance(result.get(f"{t}_ms_median"), (int, float))
        ]
        print(
            f"{result['status']} ({result['wall_s']:.0f} s{''.join('; ' + t for t in timed)})",
            flush=True,
            file=sys.stderr,
        )
        with partial.open("a") as sink:
            sink.write(json.dumps({"row": selected[number], "round": round_, **result}, default=str) + "\n")
        return result

    rows = []
    for name, runs in zip(selected, repeats.run_repeats(order, run, len(selected))):
        index = names.index(name)
        row = repeats.aggregate(runs, bench.timings)
        if row["status"] == "ok":  # from the median time, as the table shows it
            row["images_per_s"] = setting.batch * 1000 / row[f"{bench.timings[-1]}_ms_median"]
        rows.append(
            {
                "name": name,
                "label": bench.rows[index].label,
                "adds": row_adds(bench.rows[index], setting),
                "overrides": row_overrides(bench, index, setting),
                **row,
            }
        )
    run_info = {
        "command": shlex.join(["python", "-m", "lit_amp_det", "bench", kind, *argv]),
        "environment": _environment(setting.device),
        "state": state,
        "repeats": args.repeats,
        "one_process": args.one_process,
        "run_order": [{"position": k, "round": r, "row": selected[i]} for k, (r, i) in enumerate(order)],
    }
    print(write_report(bench, rows, setting, run_info, out))
    print(f"\nwritten to {out}/bench_{kind}.{{md,json}}")


#: ``bench train``, ``bench infer`` and ``bench precision``: :func:`main` of that kind, taking the rest of the
#: argv
train = functools.partial(main, "train")
infer = functools.partial(main, "infer")
precision = functools.partial(main, "precision")

if __name__ == "__main__":  # a row process: python -m lit_amp_det.bench.e2e <kind> --row=NAME ...
    main(sys.argv[1], sys.argv[2:])

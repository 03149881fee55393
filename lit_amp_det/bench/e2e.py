"""The command line of ``bench train`` and ``bench infer``: parse the setting, prepare the shared state and the
device's peaks, run each row's repeats in their own processes, write the report.

Before any row: the model state every row loads (:mod:`lit_amp_det.bench.state`, ``--state``) and the
device's peak GFLOP/s (:mod:`lit_amp_det.bench.roofline`), both cached. Then ``--repeats`` rounds, each row
once per round (:mod:`lit_amp_det.bench.repeats`), every run in a fresh process (memory the allocators keep,
compiled code and installed wrappers must not leak into the next row); a row whose process fails becomes a
``failed`` row with the error's last line, and the others are still reported. The rows themselves are in
:mod:`lit_amp_det.bench.e2e_rows`, the report in :mod:`lit_amp_det.bench.e2e_report`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lit_amp_det.bench import repeats, roofline
from lit_amp_det.bench.common import cache_root
from lit_amp_det.bench.e2e_report import environment, write_report
from lit_amp_det.bench.e2e_rows import (HALF_CHOICES, Bench, Row, Setting, default_half, default_num_classes,
                                        device_defaults, mixed_precision, row_overrides, setting_half)

__all__ = ["DEFAULT_REPEATS", "DEFAULT_STATE_STEPS", "add_repeat_options", "default_rows", "finish_row", "main",
           "parse_size", "prepare", "run_row_process"]

#: Repeats per row, on a CPU and on CUDA alike: GPU clocks and cudnn.benchmark's choices vary per process too.
DEFAULT_REPEATS = 3
#: Training steps of the trained state: past the recipe's 100 warm-up steps.
DEFAULT_STATE_STEPS = 200

#: Marks the one stdout line of a row process that carries its result.
_MARKER = "BENCH_ROW "


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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value <= 60:
        raise argparse.ArgumentTypeError(f"must be in (0, 60] seconds, got {value}")
    return value


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


def add_repeat_options(parser: argparse.ArgumentParser) -> None:
    """``--repeats``, ``--seed``, ``--state``, ``--state-steps``, ``--cache-dir``, ``--peak-seconds``: shared by
    ``bench train``, ``bench infer`` and ``bench precision``."""
    parser.add_argument("--repeats", type=_positive(1), default=DEFAULT_REPEATS,
                        help=f"runs of each row, each in a fresh process, in rounds of one run per row "
                             f"(default {DEFAULT_REPEATS}); a row's time is the median of its runs' medians")
    parser.add_argument("--seed", type=_positive(0),
                        help="shuffle the rows' order in every round with this seed (default: table order, "
                             "A B C A B C ...)")
    parser.add_argument("--state", choices=["trained", "random"], default="trained",
                        help="model state every row loads: trained (default; --state-steps of the SGD recipe on "
                             "the shapes data, made once and cached) or random (the seeded initialisation)")
    parser.add_argument("--state-steps", type=_positive(1), default=DEFAULT_STATE_STEPS,
                        help=f"training steps of the trained state (default {DEFAULT_STATE_STEPS})")
    parser.add_argument("--cache-dir", type=Path,
                        help="where the state and the peaks are cached (default: $LIT_AMP_DET_CACHE or "
                             "~/.cache/lit_amp_det, as paths.cache_dir)")
    parser.add_argument("--peak-seconds", type=_seconds, default=0.5,
                        help="time one peak-measuring matmul should take, when the peaks are not cached yet "
                             "(default 0.5)")


def _parser(bench: Bench) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m lit_amp_det bench {bench.kind}", description=bench.doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available, else cpu")
    parser.add_argument("--model", help="model config (conf/model/*.yaml); default maskrcnn_r50_fpn on cuda, "
                                        "maskrcnn_light on cpu")
    parser.add_argument("--batch", type=_positive(1), help="images per step (default 8 on cuda, 4 on cpu)")
    parser.add_argument("--size", type=parse_size, help="SIDE or HEIGHTxWIDTH (default 800x1333 on cuda, 224 on cpu)")
    parser.add_argument("--num-classes", type=_positive(2),
                        help="classes incl. background (default 81, COCO's, for maskrcnn_r50_fpn; else 7: "
                             "background and the shapes data's 6)")
    parser.add_argument("--steps", type=_positive(1), help="timed steps per row (default 20 on cuda, 10 on cpu)")
    parser.add_argument("--warmup", type=_positive(0), help="untimed steps per row (default 5 on cuda, 3 on cpu)")
    parser.add_argument("--compile-warmup", type=_positive(0),
                        help="untimed steps for rows with model.compile set (default: --warmup + 3)")
    parser.add_argument("--precision", choices=HALF_CHOICES, default="auto",
                        help="the half precision of the rows that change precision (autocast, half weights, the "
                             "fp16/bf16-only layers); auto: fp16 on cuda, bf16 on a CPU with native bf16, fp32 on "
                             "other CPUs, where the rows that change nothing in fp32 are left out unless --rows "
                             "names them")
    parser.add_argument("--rows", type=_row_names(bench.rows),
                        help=f"comma-separated subset of {','.join(r.name for r in bench.rows)} (default: all); "
                             "a row keeps the overrides of the rows above it whether they run or not")
    parser.add_argument("--out", type=Path, help=f"output directory (default: ${{LIT_AMP_DET_RUNS:-runs}}/bench/"
                                                 f"{bench.kind}/<YYYY-mm-dd_HH-MM-SS>)")
    add_repeat_options(parser)
    steps = "train each row this many more steps" if bench.kind == "train" else "call each row this many more times"
    parser.add_argument("--drift-steps", type=_positive(0), default=0,
                        help=f"after the measurements, {steps} on batches that change every step (new shapes "
                             "images) and report how much its heap in use and resident set grow (default 0: not "
                             "measured; 40 shows a pile-up)")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run this one row, print its JSON line
    parser.add_argument("--state-file", help=argparse.SUPPRESS)  # internal: the state the row loads
    parser.add_argument("--timing-lr", type=float, help=argparse.SUPPRESS)  # internal: the timed steps' lr
    return parser


def _setting(bench: Bench, args: argparse.Namespace, parser: argparse.ArgumentParser) -> Setting:
    from lit_amp_det.app.config import config_groups

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
                   num_classes=args.num_classes or default_num_classes(model),
                   steps=args.steps or defaults["steps"], warmup=warmup,
                   compile_warmup=warmup + 3 if args.compile_warmup is None else args.compile_warmup,
                   state=args.state, state_steps=args.state_steps if args.state == "trained" else 0,
                   checkpoint=args.state_file, lr=args.timing_lr, drift_steps=args.drift_steps,
                   half=default_half(device) if args.precision == "auto" else args.precision)


def _setting_argv(setting: Setting) -> list[str]:
    argv = [f"--device={setting.device}", f"--model={setting.model}", f"--batch={setting.batch}",
            f"--size={setting.size}", f"--num-classes={setting.num_classes}", f"--steps={setting.steps}",
            f"--warmup={setting.warmup}", f"--compile-warmup={setting.compile_warmup}", f"--state={setting.state}",
            f"--state-steps={max(setting.state_steps, 1)}"]
    if setting.checkpoint is not None:
        argv.append(f"--state-file={setting.checkpoint}")
    if setting.lr is not None:
        argv.append(f"--timing-lr={setting.lr!r}")
    if setting.drift_steps:
        argv.append(f"--drift-steps={setting.drift_steps}")
    if setting.half is not None:
        argv.append(f"--precision={setting.half}")
    return argv


def default_rows(bench: Bench, setting: Setting) -> list[str]:
    """Every row, less those that change nothing in the rows' half precision: ``Row.needs_half`` rows when it is
    fp32, ``Row.needs_fp32`` rows when it is fp16/bf16."""
    fp32 = setting_half(setting) == "fp32"
    return [row.name for row in bench.rows if not (row.needs_half and fp32) and not (row.needs_fp32 and not fp32)]


def prepare(setting: Setting, args: argparse.Namespace, dtypes: Sequence[str]) -> tuple[Setting, dict[str, Any]]:
    """The shared state (made or found in the cache) and the device's peaks for ``dtypes``, before any row runs.

    Returns the setting with the state's file and timing learning rate filled in, and ``{"state", "peaks"}``
    for the report: the state's record (``None`` for ``--state random``) and :func:`roofline.device_peaks`.
    """
    from lit_amp_det.bench.state import ensure_state

    cache = cache_root(args.cache_dir)
    state = None
    if setting.state == "trained":
        state = ensure_state(setting, setting.state_steps, cache)
        state = {k: v for k, v in state.items() if k != "losses"}
        setting = dataclasses.replace(setting, checkpoint=state["file"], lr=state["final_lr"])
    print(f"peak GFLOP/s of {', '.join(dtypes)} on this machine ...", end=" ", file=sys.stderr, flush=True)
    peaks = roofline.device_peaks(setting.device, dtypes, cache, args.peak_seconds)
    where = " (cached)"
    if peaks["measured"]:
        where = (" (measured under load: not cached)" if (peaks["busy_cpus"] or 0) > roofline.MAX_BUSY_CPUS_TO_CACHE
                 else f" (measured; cached in {peaks['file']})")
    print(", ".join(f"{d} {p['gflops']:.0f}" for d, p in peaks["peaks"].items()) + where, file=sys.stderr, flush=True)
    return setting, {"state": state, "peaks": peaks}


def finish_row(row: dict[str, Any], batch: int, flop_timing: str, peaks: dict[str, Any]) -> dict[str, Any]:
    """Adds what follows from a row's aggregated median: ``images_per_s`` and the roofline figures."""
    if row.get("status") != "ok":
        return row
    median = row[f"{flop_timing}_ms_median"]
    row["images_per_s"] = batch * 1000 / median
    gflop = row.get("gflop_per_step")
    row.update(roofline.roofline(gflop, median, row["compute_dtype"], peaks["peaks"]))
    model = row.get("model_gflop_per_step")
    if model is not None and gflop is not None and abs(model - gflop) > 1e-6 * gflop:  # an algorithm with fewer FLOPs
        of_model = roofline.roofline(model, median, row["compute_dtype"], peaks["peaks"])
        row["model_achieved_gflops"], row["model_peak_fraction"] = of_model["achieved_gflops"], of_model["peak_fraction"]
    return row


def _report_row(bench: Bench, index: int, setting: Setting, runs: list[dict[str, Any]],
                peaks: dict[str, Any]) -> dict[str, Any]:
    """The report's row for ``bench.rows[index]``: its name and overrides, and its repeats aggregated."""
    row = bench.rows[index]
    override = row.override_on(setting)
    return finish_row({"name": row.name, "label": row.label, "override": override,
                       "overrides": row_overrides(bench.rows, index, setting),
                       **repeats.aggregate(runs, bench.timings)}, setting.batch, bench.flop_timing, peaks)


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
        if setting.state == "trained" and setting.checkpoint is None:
            parser.error("--row with --state trained needs --state-file (the parent process makes the state)")
        index = names.index(args.row)
        result = bench.run_row(index, setting)
        print(_MARKER + json.dumps({"name": args.row, **result}), flush=True)
        return
    selected = args.rows or default_rows(bench, setting)
    out = args.out or _out_dir(bench.kind)
    command = shlex.join(["python", "-m", "lit_amp_det", "bench", bench.kind, *argv])
    half_dtype = roofline.compute_dtype(mixed_precision(setting.device, setting.half))
    setting, prepared = prepare(setting, args, list(dict.fromkeys(["fp32", half_dtype])))
    env = environment(setting.device)  # the load average before the rows run
    order = repeats.run_order(len(selected), args.repeats, args.seed)

    def run(number: int, round_: int, position: int) -> dict[str, Any]:
        row = bench.rows[names.index(selected[number])]
        print(f"[{position + 1}/{len(order)}] round {round_ + 1}: {row.label} ...", end=" ", flush=True,
              file=sys.stderr)
        result = run_row_process(bench, names.index(selected[number]), setting)
        print(f"{result['status']} ({result['wall_s']:.0f} s)", flush=True, file=sys.stderr)
        return result

    results = repeats.run_repeats(order, run, len(selected))
    rows = [_report_row(bench, names.index(name), setting, runs, prepared["peaks"])
            for name, runs in zip(selected, results)]
    if hasattr(os, "getloadavg"):
        env["load_average_after"] = list(os.getloadavg())
    run_info = {**prepared, "repeats": args.repeats, "order_seed": args.seed,
                "run_order": [{"position": k, "round": r, "row": selected[i]} for k, (r, i) in enumerate(order)]}
    text = write_report(bench, rows, setting, env, command, out, run_info)
    print(text)
    print(f"\nwritten to {out}/bench_{bench.kind}.{{md,json,png}}")

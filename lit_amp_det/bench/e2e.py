"""The command line of ``bench train`` and ``bench infer``: parse the setting, run each row in its own process,
write the report.

Every row runs in a fresh process (memory the allocators keep, compiled code and installed wrappers must not
leak into the next row); a row whose process fails becomes a ``failed`` row with the error's last line, and
the others are still reported. The rows themselves are in :mod:`lit_amp_det.bench.e2e_rows`, the report in
:mod:`lit_amp_det.bench.e2e_report`.
"""

from __future__ import annotations

import argparse
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

from lit_amp_det.bench.e2e_report import environment, write_report
from lit_amp_det.bench.e2e_rows import Bench, Row, Setting, device_defaults, mixed_precision, row_overrides

__all__ = ["main", "parse_size", "run_row_process"]

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

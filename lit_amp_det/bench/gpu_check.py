"""``make gpu-check`` (``python -m lit_amp_det.bench.gpu_check``): everything that needs a GPU, in one command.

On a machine with a CUDA GPU it runs, each step in its own process and in this order:

1. the tests marked ``cuda`` (``pytest -m cuda tests``), compiled: the ops' Triton kernels against torchvision's CUDA
   ops, the host-sync counts, a Trainer on the GPU applying its speedups;
2. ``bench ops --device cuda``;
3. ``bench train`` and ``bench infer`` on R50-FPN, 800x1333, batch 8: by default four rows each (torchvision fp32,
   + autocast, all on but sync_free and compile, + sync_free) and in training a fifth, the whole step as one CUDA
   graph, from the seeded initialisation, one repeat, to fit a short lease; ``--full`` runs every row from the trained state with the benches' repeats.

It writes ``gpu_check.md`` (test summary, the tables, device, versions, each step's wall time) into ``--out``,
rewritten after every step so that a run stopped by a time limit keeps what it measured. ``--repeats``, ``--steps``,
``--warmup`` and ``--state-steps`` go to both benches. Without a GPU it stops at once: it never writes a figure it did
not measure.

``--rehearse`` runs the steps on the CPU (interpreter, tiny model at 64 px, one step; NMS and IoU ops once): what a
first contact needs besides the GPU (packages; no pip, network or cache) and what the steps cost around the GPU's work,
timed. Its report says so; none of its figures is a GPU figure.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["main"]

REPO = Path(__file__).resolve().parents[2]
#: the tests that run on a GPU (marker ``cuda``); the CPU cases ran in CI already
CUDA_TESTS = ["-m", "cuda", "tests"]
#: bench options ``gpu_check`` forwards to ``bench train`` and ``bench infer`` when given.
BENCH_OPTIONS = ("repeats", "steps", "warmup", "state_steps")
#: what the benches run without ``--full``: first and last rows of the speedups (each row adds its override to the row
#: above, whether that ran or not), one repeat, the seeded initialisation (no state to train first)
QUICK = {"train": ["--rows", "torchvision-fp32,autocast,fused-optim,sync-free,step-graph"],
         "infer": ["--rows", "torchvision-fp32,autocast,convbn-fold,sync-free"]}
QUICK_OPTIONS = ["--state", "random", "--repeats", "1", "--steps", "8", "--warmup", "3"]
#: ``--rehearse``: the smallest run of each step on the CPU
REHEARSAL = {"ops": ["--only", "nms,iou", "--repeats", "1", "--warmup", "0"],
             "bench": ["--model", "maskrcnn_tiny", "--size", "64", "--batch", "2", "--steps", "1", "--warmup", "0"]}


def _run(title: str, command: list[str], log: Path, interpret: bool = False) -> tuple[int, str]:
    """Runs one step, its output streamed to the terminal and ``log``; (exit code, output). Interpreted if asked."""
    print(f"\n== {title}: {' '.join(command)}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    lines = []
    with log.open("w") as sink, subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                                  stderr=subprocess.STDOUT, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            sink.write(line)
            sink.flush()
            print(line, end="", flush=True)
    return proc.returncode, "".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_amp_det.bench.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="output directory (default runs/gpu_check/<timestamp>)")
    parser.add_argument("--skip", default="", help="comma-separated steps to skip: tests,ops,train,infer")
    for option in BENCH_OPTIONS:
        flag = "--" + option.replace("_", "-")
        parser.add_argument(flag, type=int, help=f"bench train/infer {flag} (default: the bench's)")
    parser.add_argument("--full", action="store_true", help="every bench row, trained state, the benches' repeats")
    parser.add_argument("--rehearse", action="store_true",
                        help="the same steps on the CPU, smallest sizes: first-contact needs and the steps' overheads")
    args = parser.parse_args(argv)
    if args.rehearse and args.full:
        parser.error("--rehearse runs the smallest steps on the CPU; --full the whole benches on a GPU: choose one")
    if not args.rehearse and not torch.cuda.is_available():
        raise SystemExit("gpu-check needs a CUDA GPU and torch sees none: nothing was run or measured. Run "
                         "`make gpu-check` on a GPU machine (after `make install`), or rehearse its steps on this "
                         "CPU with ARGS=--rehearse.")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if unknown := skip - {"tests", "ops", "train", "infer"}:
        raise SystemExit(f"--skip: unknown step(s) {sorted(unknown)}; choose from tests, ops, train, infer")
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = (args.out or Path(os.environ.get("LIT_AMP_DET_RUNS", "runs")) / "gpu_check" / stamp).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import triton
    python = sys.executable
    device = "cpu" if args.rehearse else "cuda"
    machine = ("REHEARSAL on the CPU (Triton interpreter, smallest sizes): the steps' overheads, no GPU figure"
               if args.rehearse else
               f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
    sections = ["# gpu-check", f"{machine}, torch {torch.__version__}, triton {triton.__version__}, {stamp}"]
    times: list[str] = []
    report = out / "gpu_check.md"
    failed: list[str] = []

    def step(name: str, title: str, command: list[str]) -> tuple[int, str]:
        started = time.perf_counter()
        code, output = _run(title, command, out / f"{name}.log", interpret=args.rehearse)
        times.append(f"| {name} | {time.perf_counter() - started:.0f} | {code} |")
        return code, output

    def record(name: str, code: int, *section: str) -> None:
        sections.extend(section)
        if code:
            failed.append(name)
        table = "| step | s | exit code |\n|---|---:|---:|\n" + "\n".join(times)
        timing = ["## Steps (wall time)", table] if times else []
        report.write_text("\n\n".join([*sections, *timing]) + "\n")
    record("", 0)  # the header alone, before the first step
    if "tests" not in skip:
        # xdist (when installed) spreads the Triton compiles over the cores
        pytest = ["-m", "pytest", "-q", *CUDA_TESTS]
        if importlib.util.find_spec("xdist") is not None:
            pytest += ["-n", str(min(8, os.cpu_count() or 1))]
        code, output = step("tests", "tests on CUDA", [python, *pytest])
        summary = [line for line in output.splitlines() if " passed" in line or " failed" in line or " skipped" in line]
        heading = ("## Tests marked cuda (they skip without a GPU)" if args.rehearse
                   else "## Tests on CUDA (compiled Triton kernels)")
        record("tests", code, heading,
               f"`pytest -q {' '.join(CUDA_TESTS)}`: " + (summary[-1] if summary else f"exit code {code}"))
    if "ops" not in skip:
        options = REHEARSAL["ops"] if args.rehearse else []
        code, output = step("ops", "bench ops", [python, "-m", "lit_amp_det", "bench", "ops", "--device", device,
                                                 *options, "--json", str(out / f"ops_{device}.json")])
        table = "\n".join(line for line in output.splitlines() if line.startswith("|"))
        record("ops", code, f"## Ops (`python -m lit_amp_det bench ops --device {device} {' '.join(options)}`)",
               table or "(no table)")
    forwarded = [f"--{option.replace('_', '-')}={getattr(args, option)}" for option in BENCH_OPTIONS
                 if getattr(args, option) is not None]
    for bench in [b for b in ("train", "infer") if b not in skip]:
        directory = out / f"bench_{bench}"
        options = forwarded if args.full else [*QUICK[bench], *QUICK_OPTIONS, *forwarded]  # argparse: the last wins
        if args.rehearse:
            options = [*options, *REHEARSAL["bench"]]
        code, _ = step(bench, f"bench {bench}", [python, "-m", "lit_amp_det", "bench", bench, "--device", device,
                                                 "--out", str(directory), *options])
        size = "tiny model, 64 px, batch 2" if args.rehearse else "R50-FPN, 800x1333, batch 8"
        title = f"## `python -m lit_amp_det bench {bench} {' '.join(options)}` ({size})"
        found = sorted(directory.rglob(f"bench_{bench}.md"), key=lambda p: p.stat().st_mtime)
        record(bench, code, title,
               found[-1].read_text() if found else f"(bench_{bench}.md was not written; see the step's log)")
    print(f"\nwrote {report}")
    if failed:
        raise SystemExit(f"gpu-check: these steps failed: {', '.join(failed)} (logs in {out})")


if __name__ == "__main__":
    main()

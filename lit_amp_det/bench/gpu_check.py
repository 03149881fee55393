"""``make gpu-check`` (``python -m lit_amp_det.bench.gpu_check``): everything that needs a GPU, in one
command.

On a machine with a CUDA GPU it runs, each step in its own process and in this order:

1. ``build``: the C++ extension, in place (incremental: a no-op once built);
2. the tests marked ``cuda`` (``pytest -m cuda tests``) in one process, so that each Triton kernel compiles
   once, into the cache the later steps read: the ops' kernels against torchvision's CUDA ops, the host-sync
   counts, a Trainer on the GPU applying its speedups;
3. ``bench ops --device cuda``;
4. ``bench train`` and ``bench infer`` on R50-FPN, 800x1333, batch 8: by default four rows each (torchvision
   fp32, + autocast, all on but sync_free and compile, + sync_free) and in training a fifth, the whole step as
   one CUDA graph, from the seeded initialisation, one repeat, all rows in one process (none compiles, so none
   leaves compiled code to the next; each is built anew from the same state), to fit a short lease; ``--full``
   runs every row from the trained state with the benches' repeats, each in its own process.

The default run is designed to end within six minutes on an H100: each step has its budget in
:data:`STEP_BUDGET_S` and is stopped when it overruns it (recorded as timed out; the next step runs).
``--full`` has no budgets.

It writes ``gpu_check.md`` (test summary, the tables, device, versions, each step's wall time against its
budget) into ``--out``, rewritten after every step so that a run stopped by a time limit keeps what it
measured. ``--repeats``, ``--steps``, ``--warmup`` and ``--state-steps`` go to both benches. Without a GPU it
stops at once: it never writes a figure it did not measure.

``--rehearse`` runs the steps on the CPU (interpreter, tiny model at 64 px, one step; NMS and IoU ops once):
what a first contact needs besides the GPU (packages; no pip, network or cache) and what the steps cost around
the GPU's work, timed: each step's time next to its GPU budget, and the total. Its steps stop only at
:data:`REHEARSAL_TIMEOUT_S` (the interpreter is slower than a GPU by far). Its report says so; none of its
figures is a GPU figure.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = ["REHEARSAL_TIMEOUT_S", "STEP_BUDGET_S", "Outcome", "main"]

REPO = Path(__file__).resolve().parents[2]
#: the tests that run on a GPU (marker ``cuda``); the CPU cases ran in CI already. One process: each Triton
#: kernel compiles once (xdist workers would each compile all of them), into the cache the later steps read.
CUDA_TESTS = ["-p", "no:xdist", "-m", "cuda", "tests"]
#: The design of the default run on an H100, in seconds a step may take before it is stopped: they add up to
#: six minutes. ``build`` is a no-op once built and a parallel compile of the CPU kernels otherwise; ``tests``
#: compiles every Triton kernel once; ``train`` and ``infer`` pay the imports, the CUDA context and the model
#: once, then a dozen (train) or two dozen (infer) R50-FPN steps per row.
STEP_BUDGET_S = {"build": 45, "tests": 120, "ops": 30, "train": 90, "infer": 75}
#: ``--rehearse``: the limit of each step on the CPU, where the Triton interpreter stands in for the GPU (a
#: hang guard).
REHEARSAL_TIMEOUT_S = 900
#: bench options ``gpu_check`` forwards to ``bench train`` and ``bench infer`` when given.
BENCH_OPTIONS = ("repeats", "steps", "warmup", "state_steps")
#: what the benches run without ``--full``: first and last rows of the speedups (each row adds its override to
#: the row above, whether that ran or not), one repeat, the seeded initialisation (no state to train first)
QUICK = {
    "train": ["--rows", "torchvision-fp32,autocast,fused-optim,sync-free,step-graph"],
    "infer": ["--rows", "torchvision-fp32,autocast,convbn-fold,sync-free"],
}
QUICK_OPTIONS = ["--state", "random", "--repeats", "1", "--steps", "8", "--warmup", "3", "--one-process"]
#: ``--rehearse``: the smallest run of each step on the CPU
REHEARSAL = {
    "ops": ["--only", "nms,iou", "--repeats", "1", "--warmup", "0"],
    "bench": ["--model", "maskrcnn_tiny", "--size", "64", "--batch", "2", "--steps", "1", "--warmup", "0"],
}


class Outcome(NamedTuple):
    """How a step ended: its exit code (None when stopped), its output, and whether it overran its limit."""

    code: int | None
    output: str
    timed_out: bool


def _stop(proc: subprocess.Popen) -> None:
    """Stops ``proc`` and every process it started (its session): SIGTERM, then SIGKILL after five seconds."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _run(
    title: str, command: list[str], log: Path, timeout: float | None, interpret: bool = False
) -> Outcome:
    """Runs one step, its output streamed to the terminal and ``log``, interpreted if asked; stopped with
    everything it started when it runs past ``timeout`` seconds (None: no limit).

    Args:
        title: the step's name on the terminal.
        command: the step's command line, run in the repository root.
        log: the file its output goes to.
        timeout: seconds the step may take.
        interpret: run Triton's kernels in its interpreter (``TRITON_INTERPRET=1``).

    Returns:
        Its exit code (None when stopped), its output, and whether it was stopped for overrunning ``timeout``.
    """
    print(f"\n== {title}: {' '.join(command)}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    lines: list[str] = []
    with (
        log.open("w") as sink,
        subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        ) as proc,
    ):

        def stream() -> None:
            for line in proc.stdout:
                lines.append(line)
                sink.write(line)
                sink.flush()
                print(line, end="", flush=True)

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            _stop(proc)
            timed_out = True
        reader.join(timeout=10)
    if timed_out:
        note = f"\n== {title}: stopped after {timeout:.0f} s (its time limit)\n"
        print(note, end="", flush=True)
        with log.open("a") as sink:
            sink.write(note)
    return Outcome(None if timed_out else proc.returncode, "".join(lines), timed_out)


def _ending(outcome: Outcome) -> str:
    """How a step ended, in words."""
    return "timed out" if outcome.timed_out else f"exit code {outcome.code}"


def _arguments(argv: Sequence[str] | None) -> tuple[argparse.Namespace, set[str]]:
    """The command line, checked, and the set of steps to skip; exits with the reason when it cannot run."""
    parser = argparse.ArgumentParser(
        prog="python -m lit_amp_det.bench.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, help="output directory (default runs/gpu_check/<timestamp>)")
    parser.add_argument(
        "--skip", default="", help=f"comma-separated steps to skip: {','.join(STEP_BUDGET_S)}"
    )
    for option in BENCH_OPTIONS:
        flag = "--" + option.replace("_", "-")
        parser.add_argument(flag, type=int, help=f"bench train/infer {flag} (default: the bench's)")
    parser.add_argument(
        "--full", action="store_true", help="every bench row, trained state, the benches' repeats"
    )
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="the same steps on the CPU, smallest sizes: first-contact needs and the steps' overheads",
    )
    args = parser.parse_args(argv)
    if args.rehearse and args.full:
        parser.error(
            "--rehearse runs the smallest steps on the CPU; --full the whole benches on a GPU: choose one"
        )
    if not args.rehearse and not torch.cuda.is_available():
        raise SystemExit(
            "gpu-check needs a CUDA GPU and torch sees none: nothing was run or measured. Run "
            "`make gpu-check` on a GPU machine (after `make install`), or rehearse its steps on this "
            "CPU with ARGS=--rehearse."
        )
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if unknown := skip - set(STEP_BUDGET_S):
        raise SystemExit(f"--skip: unknown step(s) {sorted(unknown)}; choose from {', '.join(STEP_BUDGET_S)}")
    return args, skip


def main(argv: Sequence[str] | None = None) -> None:
    args, skip = _arguments(argv)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = (args.out or Path(os.environ.get("LIT_AMP_DET_RUNS", "runs")) / "gpu_check" / stamp).resolve()
    out.mkdir(parents=True, exist_ok=True)
    import triton

    python = sys.executable
    device = "cpu" if args.rehearse else "cuda"
    machine = (
        "REHEARSAL on the CPU (Triton interpreter, smallest sizes): the steps' overheads, no GPU figure"
        if args.rehearse
        else f"{torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})"
    )
    sections = ["# gpu-check", f"{machine}, torch {torch.__version__}, triton {triton.__version__}, {stamp}"]
    times: list[str] = []
    report = out / "gpu_check.md"
    failed: list[str] = []
    spent = [0.0]

    def limit(name: str) -> float | None:
        """The step's time limit: its budget on a GPU, the hang guard in a rehearsal, none in a full run."""
        if args.rehearse:
            return REHEARSAL_TIMEOUT_S
        return None if args.full else STEP_BUDGET_S[name]

    def step(name: str, title: str, command: list[str]) -> Outcome:
        started = time.perf_counter()
        outcome = _run(title, command, out / f"{name}.log", limit(name), interpret=args.rehearse)
        seconds = time.perf_counter() - started
        spent[0] += seconds
        result = f"timed out after {limit(name):.0f} s" if outcome.timed_out else f"exit code {outcome.code}"
        times.append(f"| {name} | {STEP_BUDGET_S[name]} | {seconds:.0f} | {result} |")
        return outcome

    def record(name: str, outcome: Outcome | None, *section: str) -> None:
        sections.extend(section)
        if outcome is not None and (outcome.timed_out or outcome.code):
            failed.append(name)
        clock = "CPU s (rehearsal)" if args.rehearse else "s"
        table = (
            f"| step | GPU budget s | {clock} | result |\n|---|---:|---:|---|\n"
            + "\n".join(times)
            + f"\n| total | {sum(STEP_BUDGET_S.values())} | {spent[0]:.0f} | |"
        )
        if args.rehearse:
            rule = f"this rehearsal on the CPU stops a step only after {REHEARSAL_TIMEOUT_S} s"
        elif args.full:
            rule = "--full runs without them"
        else:
            rule = "a step that overruns its budget is stopped and the next one runs"
        budget = f"GPU budget: the design of the default run on an H100, six minutes in all; {rule}."
        timing = ["## Steps (wall time)", budget, table] if times else []
        report.write_text("\n\n".join([*sections, *timing]) + "\n")

    record("", None)  # the header alone, before the first step
    if "build" not in skip:
        outcome = step(
            "build", "the C++ extension", [python, "setup.py", "--quiet", "build_ext", "--inplace"]
        )
        record("build", outcome)
    if "tests" not in skip:
        outcome = step("tests", "tests on CUDA", [python, "-m", "pytest", "-q", *CUDA_TESTS])
        summary = [
            line
            for line in outcome.output.splitlines()
            if " passed" in line or " failed" in line or " skipped" in line
        ]
        heading = (
            "## Tests marked cuda (they skip without a GPU)"
            if args.rehearse
            else "## Tests on CUDA (compiled Triton kernels)"
        )
        record(
            "tests",
            outcome,
            heading,
            f"`pytest -q {' '.join(CUDA_TESTS)}`: " + (summary[-1] if summary else _ending(outcome)),
        )
    if "ops" not in skip:
        options = REHEARSAL["ops"] if args.rehearse else []
        outcome = step(
            "ops",
            "bench ops",
            [
                python,
                "-m",
                "lit_amp_det",
                "bench",
                "ops",
                "--device",
                device,
                *options,
                "--json",
                str(out / f"ops_{device}.json"),
            ],
        )
        table = "\n".join(line for line in outcome.output.splitlines() if line.startswith("|"))
        record(
            "ops",
            outcome,
            f"## Ops (`python -m lit_amp_det bench ops --device {device} {' '.join(options)}`)",
            table or "(no table)",
        )
    forwarded = [
        f"--{option.replace('_', '-')}={getattr(args, option)}"
        for option in BENCH_OPTIONS
        if getattr(args, option) is not None
    ]
    for bench in [b for b in ("train", "infer") if b not in skip]:
        directory = out / f"bench_{bench}"
        options = (
            forwarded if args.full else [*QUICK[bench], *QUICK_OPTIONS, *forwarded]
        )  # argparse: the last wins
        if args.rehearse:
            options = [*options, *REHEARSAL["bench"]]
        outcome = step(
            bench,
            f"bench {bench}",
            [
                python,
                "-m",
                "lit_amp_det",
                "bench",
                bench,
                "--device",
                device,
                "--out",
                str(directory),
                *options,
            ],
        )
        size = "tiny model, 64 px, batch 2" if args.rehearse else "R50-FPN, 800x1333, batch 8"
        title = f"## `python -m lit_amp_det bench {bench} {' '.join(options)}` ({size})"
        found = sorted(directory.rglob(f"bench_{bench}.md"), key=lambda p: p.stat().st_mtime)
        record(
            bench,
            outcome,
            title,
            found[-1].read_text()
            if found
            else f"(bench_{bench}.md was not written ({_ending(outcome)}); see the step's log)",
        )
    print(f"\nwrote {report}")
    if failed:
        raise SystemExit(f"gpu-check: these steps failed: {', '.join(failed)} (logs in {out})")


if __name__ == "__main__":
    main()

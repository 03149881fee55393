"""Command line: ``python -m lit_amp_det {fit,validate,test,predict,export} [hydra overrides]``.

Hydra owns everything after the subcommand (overrides, ``-m`` for multirun, ``--cfg job``, ``--info``,
``--hydra-help``); the subcommand itself is taken off ``argv`` and handed to Hydra as ``command=...``
because Hydra has no notion of subcommands. ``--help`` prints the subcommands and config groups.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import hydra
from omegaconf import DictConfig

from lit_amp_det.app.config import COMMANDS, config_dir, config_groups
from lit_amp_det.app.launch import launch_rank
from lit_amp_det.app.runs import holds_a_run, is_earlier_attempt
from lit_amp_det.precision.modes import PRECISIONS
from lit_amp_det.slurm import current_job

__all__ = ["hydra_argv", "main", "usage"]

_DESCRIPTIONS = {
    "fit": "train, validating every trainer.check_val_every_n_epoch epochs; ckpt_path=last resumes the "
    "newest unfinished fit",
    "validate": "score a checkpoint (ckpt_path=... or model.weights=...) on the validation split",
    "test": "score a checkpoint on the test split",
    "predict": "write COCO-format detections of data.predict_split (or of the pictures in "
    "data.predict_images) to predictions.json",
    "export": "write the model (ckpt_path=... or model.weights=...) as format=onnx|pt2 with a JSON "
    "description",
    "bench": "benchmarks: `bench train|infer` (each optimisation added in turn), "
    "`bench precision|ops|convbn|coco_eval`",
}


def usage() -> str:
    """The text of ``--help``: subcommands, config groups with their options, and examples."""
    lines = [
        "usage: python -m lit_amp_det {fit,validate,test,predict,export} [-m] [--cfg job] [key=value ...]",
        "",
        "subcommands:",
    ]
    lines += [f"  {name:<9} {_DESCRIPTIONS[name]}" for name in (*COMMANDS, "bench")]
    lines += ["", f"config groups (choose with group=option; tree at {config_dir()}):"]
    lines += [f"  {group:<10} {', '.join(options)}" for group, options in config_groups().items()]
    lines += [
        "",
        f"trainer.precision: {' | '.join(PRECISIONS)}",
        "",
        "examples:",
        "  python -m lit_amp_det fit trainer.max_steps=50          (a quick run)",
        "  python -m lit_amp_det fit trainer.precision=16-mixed",
        "  python -m lit_amp_det fit ckpt_path=last                (resume the newest unfinished fit)",
        "  python -m lit_amp_det fit data=coco data.root=/data/coco experiment=coco_r50_fpn",
        "  python -m lit_amp_det fit -m trainer.precision=32-true,bf16-mixed",
        "  python -m lit_amp_det test ckpt_path=last",
        "  python -m lit_amp_det fit --cfg job        (print the composed config and exit)",
        "  python -m lit_amp_det fit --hydra-help     (Hydra's own flags)",
    ]
    return "\n".join(lines)


@hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")
def _hydra_entry(cfg: DictConfig) -> object:
    from lit_amp_det.app.tasks import run  # heavy imports only once Hydra has parsed the command line

    return run(cfg)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m lit_amp_det`` and the ``lit-amp-det`` console script."""
    try:
        _main(argv)
    except BrokenPipeError:  # `... | head` left before the output ended: no traceback for that
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)


def _main(argv: Sequence[str] | None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return
    command, rest = args[0], args[1:]
    if command == "bench":
        from lit_amp_det.bench import main as bench_main

        bench_main(rest)
        return
    if command not in COMMANDS:
        sys.exit(
            f"lit_amp_det: unknown subcommand {command!r}; the first argument must be one of "
            f"{', '.join(COMMANDS)}, bench (see --help)"
        )
    if "-h" in rest or "--help" in rest:
        print(usage())
        return
    if (used := _used_run_dir(rest)) is not None:
        sys.exit(
            f"lit_amp_det: hydra.run.dir={used} already holds a run (run.json, metrics.json or checkpoints); "
            "runs never write into an earlier run's folder. Choose another folder (or leave hydra.run.dir "
            f"out: each run gets a new one), or resume that run into a new folder with ckpt_path={used}"
        )
    if launch_rank() and not any(arg.startswith("hydra.output_subdir=") for arg in rest):
        rest = [*rest, "hydra.output_subdir=null"]  # another node's first process: rank 0 writes .hydra/
    from lit_amp_det.app.overrides import prepare_overrides

    if (short := _short_of_room()) is not None:
        sys.exit(short)
    multirun = "-m" in rest or "--multirun" in rest
    sys.argv = [
        sys.argv[0],
        *hydra_argv(rest, command, lambda overrides: prepare_overrides(overrides, multirun)),
    ]
    try:
        _hydra_entry()
    except KeyboardInterrupt:  # while Hydra and the imports start: nothing was written yet
        print("lit_amp_det: interrupted (Ctrl-C) while starting", file=sys.stderr)
        sys.exit(130)


#: Free space below which a command does not start: its config, logs and first checkpoint would not fit.
MIN_FREE_MB = 64


def _short_of_room() -> str | None:
    """Why the runs folder's disk cannot take a run (``None`` when it can): said before anything is
    written.
    """
    root = Path(os.environ.get("LIT_AMP_DET_RUNS", "runs")).expanduser().absolute()
    existing = next(p for p in (root, *root.parents) if p.exists())
    free = shutil.disk_usage(existing).free / 2**20
    if free >= MIN_FREE_MB:
        return None
    return (
        f"lit_amp_det: {free:.0f} MB free on the disk of {root}, where runs are written: a run needs room "
        f"for its config, logs and checkpoints (at least {MIN_FREE_MB} MB). Free space there, or set "
        "LIT_AMP_DET_RUNS to a folder on another disk"
    )


#: Hydra's flags that take a value (``--cfg job``); ``--info`` takes one of ``_INFO_TOPICS`` optionally.
_FLAGS_WITH_VALUE = {
    "-c",
    "--cfg",
    "-p",
    "--package",
    "-cp",
    "--config-path",
    "-cn",
    "--config-name",
    "-cd",
    "--config-dir",
    "--experimental-rerun",
}
_INFO_TOPICS = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def _used_run_dir(args: Sequence[str]) -> str | None:
    """An explicit ``hydra.run.dir=`` that already holds a run, checked before Hydra writes ``.hydra/`` into
    it.

    DDP's other ranks (started by Lightning, or another node's processes) are given the first rank's folder on
    purpose, and a requeued SLURM job continues in its preempted attempt's folder.
    """
    if launch_rank():
        return None
    job = current_job()
    for arg in args:
        if arg.startswith("hydra.run.dir="):
            path = Path(arg.split("=", 1)[1].strip().strip("'\""))
            earlier = job is not None and is_earlier_attempt(path, job.job_id, job.restart_count)
            return str(path) if holds_a_run(path) and not earlier else None
    return None


def hydra_argv(
    args: Sequence[str], command: str, prepare: Callable[[list[str]], list[str]] | None = None
) -> list[str]:
    """Hydra's argv for ``args``: flags (with their values) first, then the overrides (passed through
    ``prepare``), then ``command=...``. Hydra's argparse rejects overrides on both sides of a flag (``seed=1
    --cfg job x=2``); moving the flags to the front accepts any order, and ``command=`` goes last so it is one
    more override.
    """
    flags: list[str] = []
    overrides: list[str] = []
    position = 0
    while position < len(args):
        token = args[position]
        position += 1
        if not token.startswith("-"):
            overrides.append(token)
            continue
        flags.append(token)
        takes_value = token in _FLAGS_WITH_VALUE
        takes_topic = token in ("-i", "--info") and position < len(args) and args[position] in _INFO_TOPICS
        if (takes_value or takes_topic) and position < len(args):
            flags.append(args[position])
            position += 1
    return [*flags, *(prepare(overrides) if prepare else overrides), f"command={command}"]

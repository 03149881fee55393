"""``python -m lit_amp_det bench precision``: train-step throughput and peak memory per precision setting.

Rows: ``32-true``, ``bf16-mixed`` and ``16-mixed`` each with the default fp32 regions and with plain
autocast (no regions), so the table shows both what mixed precision buys and what the fp32 regions cost; then
``bf16-weights`` and ``16-weights`` (half weights with fp32 masters, no autocast) with the fp32 regions.
As in ``bench train``: every row loads the same model state (``--state``, by default trained and cached, see
:mod:`lit_amp_det.bench.state`) and steps on the same batch of shapes images; each row runs ``--repeats``
times, every run in its own process (peak memory of a process only grows), in interleaved rounds; warm-up
steps are excluded, a row's time is the median over repeats of each run's median step, and its roofline
figures come from :mod:`lit_amp_det.bench.roofline`. The optimizer is SGD with momentum 0.9, fresh in every
run, at the trained state's final learning rate (1e-3 with ``--state random``). Ratios are to the ``32-true``
row of the same run. Memory is the peak above what the process held after building the model (CPU: peak
resident set; CUDA: allocator peak). The fp16 rows (``16-mixed``, ``16-weights``) run only on CUDA unless ``--fp16-on-cpu`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lit_amp_det.bench import e2e, e2e_rows, repeats, roofline
from lit_amp_det.bench.common import batch_sha256, compose, train_step, weights_sha256, write_json
from lit_amp_det.bench.e2e_report import (cpu_bf16_text, peaks_line, repeat_text, repeats_line, roofline_text,
                                          state_line)
from lit_amp_det.bench.e2e_rows import Setting
from lit_amp_det.profiling import MB, MemoryProbe, StepTimer

__all__ = ["ROWS", "main", "run_row"]

ROWS = [
    ("32-true", "regions"),
    ("bf16-mixed", "regions"),
    ("bf16-mixed", "plain"),
    ("16-mixed", "regions"),
    ("16-mixed", "plain"),
    ("bf16-weights", "regions"),
    ("16-weights", "regions"),
]

#: SGD's learning rate with ``--state random`` (the trained state brings its own).
RANDOM_STATE_LR = 1e-3


def run_row(precision: str, regions: str, setting: Setting, *, fp16_on_cpu: bool) -> dict[str, Any]:
    """Times ``setting.steps`` training steps of one configuration in this process."""
    from hydra.utils import instantiate

    from lit_amp_det.precision import build_precision_plugin

    # never reset: its peak is the process's since here, the building of the model included
    probe = MemoryProbe(setting.device)
    cfg = compose(e2e_rows.setting_overrides(setting))
    torch.manual_seed(0)  # the random state's weights; model.checkpoint, when set, replaces them all
    module = instantiate(cfg.model, _convert_="all")
    loaded = weights_sha256(module.model)
    module.to(setting.device)
    plugin = build_precision_plugin(precision, "gpu" if setting.device == "cuda" else "cpu", fp16_on_cpu=fp16_on_cpu,
                                    fp32_regions=None if regions == "regions" else {})
    plugin.convert_module(module)
    lr = setting.lr if setting.lr is not None else RANDOM_STATE_LR
    optimizer = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
    plugin.connect(module, [optimizer], [])  # as the Trainer does: low-precision weights step fp32 masters
    images, targets = e2e_rows.synthetic_batch(setting, setting.batch)
    module.train()
    base_memory = probe.peak_bytes() / MB
    timer = StepTimer(setting.device, setting.warmup)
    times = []
    for _ in range(setting.warmup + setting.steps):
        timer.start()
        loss = train_step(module, plugin, optimizer, images, targets)
        seconds = timer.stop()
        if seconds is not None:
            times.append(seconds)
    stats = e2e_rows.summarise(times)
    peak = probe.peak_bytes() / MB
    flops = roofline.count_flops(lambda: train_step(module, plugin, optimizer, images, targets))  # after timing
    actual = getattr(plugin, "precision", precision)
    return {
        "precision": actual,
        "fp32_regions": regions,
        **stats,
        "step_ms_spread": stats["step_ms_max"] - stats["step_ms_min"],
        "images_per_s": setting.batch * 1000 / stats["step_ms_median"],
        "peak_memory_mb": peak,
        "peak_memory_growth_mb": peak - base_memory,
        "final_loss": float(loss.detach()),
        "gflop_per_step": flops / 1e9,
        "compute_dtype": roofline.compute_dtype(actual),
        "weights_sha256": loaded,
        "batch_sha256": batch_sha256(images, targets),
        "lr": lr,
    }


def _table(rows: list[dict[str, Any]], setting: Setting, run: dict[str, Any]) -> str:
    base = next(r for r in rows if r["precision"] == "32-true")
    lines = [
        f"device={setting.device} model={setting.model} ({setting.num_classes} classes) batch={setting.batch} "
        f"image={setting.size} steps={setting.steps} (warm-up {setting.warmup} excluded) torch={torch.__version__}"
        + (f" CPU: {cpu_bf16_text()}" if setting.device == "cpu" else ""),
        state_line(setting, run["state"]),
        repeats_line(run),
        peaks_line(run["peaks"]),
        "",
        "| precision | fp32 regions | step ms (median) | repeats ms | spread ms | images/s | speed vs 32-true "
        "| GFLOP/s (% of peak) | training peak MB | peak vs 32-true |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['precision']} | {'-' if r['precision'] == '32-true' else r['fp32_regions']} | "
            f"{r['step_ms_median']:.0f} | {repeat_text(r, 'step')} | {r['step_ms_spread']:.0f} | "
            f"{r['images_per_s']:.2f} | {base['step_ms_median'] / r['step_ms_median']:.2f}x | {roofline_text(r)} | "
            f"{r['peak_memory_growth_mb']:.0f} | {r['peak_memory_growth_mb'] / base['peak_memory_growth_mb']:.2f}x |"
        )
    return "\n".join(lines)


def _row_process(precision: str, regions: str, setting: Setting, fp16_on_cpu: bool) -> dict[str, Any]:
    command = [sys.executable, "-m", "lit_amp_det.bench.precision", f"--row={precision}:{regions}",
               f"--model={setting.model}", f"--batch={setting.batch}", f"--size={setting.height}",
               f"--num-classes={setting.num_classes}", f"--steps={setting.steps}", f"--warmup={setting.warmup}",
               f"--device={setting.device}", f"--state={setting.state}", f"--state-steps={max(setting.state_steps, 1)}",
               *([f"--state-file={setting.checkpoint}", f"--timing-lr={setting.lr!r}"] if setting.checkpoint else []),
               *(["--fp16-on-cpu"] if fp16_on_cpu else [])]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"bench row {precision}/{regions} failed ({shlex.join(command)}):\n{out.stderr[-3000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "status": "ok"}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lit_amp_det bench precision", description=__doc__)
    parser.add_argument("--model", default="maskrcnn_light", help="model config (conf/model/*.yaml)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=224, help="square image side in pixels")
    parser.add_argument("--num-classes", type=int, help="classes incl. background (default 81 for maskrcnn_r50_fpn, "
                                                        "else 7: background and the shapes data's 6)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--fp16-on-cpu", action="store_true", help="also time 16-mixed on a CPU")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    e2e.add_repeat_options(parser)
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: run one row and print its JSON
    parser.add_argument("--state-file", help=argparse.SUPPRESS)  # internal: the state the row loads
    parser.add_argument("--timing-lr", type=float, help=argparse.SUPPRESS)  # internal: the steps' lr
    args = parser.parse_args(argv)
    setting = Setting(device=args.device, model=args.model, batch=args.batch, height=args.size, width=args.size,
                      num_classes=args.num_classes or e2e_rows.default_num_classes(args.model), steps=args.steps,
                      warmup=args.warmup, compile_warmup=args.warmup, state=args.state,
                      state_steps=args.state_steps if args.state == "trained" else 0, checkpoint=args.state_file,
                      lr=args.timing_lr)
    if args.row:
        precision, regions = args.row.split(":")
        print(json.dumps(run_row(precision, regions, setting, fp16_on_cpu=args.fp16_on_cpu)))
        return
    selected = [(p, r) for p, r in ROWS if not (p.startswith("16-") and args.device == "cpu" and not args.fp16_on_cpu)]
    dtypes = list(dict.fromkeys(roofline.compute_dtype(p) for p, _ in selected))
    setting, prepared = e2e.prepare(setting, args, dtypes)
    order = repeats.run_order(len(selected), args.repeats, args.seed)

    def run(number: int, round_: int, position: int) -> dict[str, Any]:
        print(f"[{position + 1}/{len(order)}] round {round_ + 1}: {'/'.join(selected[number])}", file=sys.stderr,
              flush=True)
        return _row_process(*selected[number], setting, args.fp16_on_cpu)

    rows = []
    for runs in repeats.run_repeats(order, run, len(selected)):
        row = repeats.aggregate(runs, ("step",))
        row["step_ms_spread"] = row["step_ms_max"] - row["step_ms_min"]  # over every timed step of every repeat
        rows.append(e2e.finish_row(row, setting.batch, "step", prepared["peaks"]))
    run_info = {**prepared, "repeats": args.repeats, "order_seed": args.seed,
                "run_order": [{"position": k, "round": r, "row": ":".join(selected[i])}
                              for k, (r, i) in enumerate(order)]}
    print(_table(rows, setting, run_info))
    options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    write_json(args.json, {"args": options, "setting": dataclasses.asdict(setting), **run_info, "rows": rows})


if __name__ == "__main__":
    main()

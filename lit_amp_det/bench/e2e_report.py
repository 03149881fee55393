"""The report of ``bench train`` and ``bench infer``: header, markdown table, JSON and bar plot of the rows.

The header states what every figure depends on besides the row's switches: the device and versions, the
setting, the model state all rows loaded, how the repeats ran and what the roofline column is measured against.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lit_amp_det.bench.breakdown import breakdown_lines
from lit_amp_det.bench.common import cpu_name
from lit_amp_det.bench.e2e_rows import Bench, Setting, low_precision_weights, mixed_precision, setting_half
from lit_amp_det.precision.hardware import cpu_capability, cpu_computes_bf16_natively

__all__ = ["cpu_bf16_text", "each_repeat_text", "environment", "half_line", "peaks_line", "plot",
           "previous_ratio_text", "ratio_text", "repeat_text", "repeats_line", "roofline_text", "state_line", "table",
           "write_report"]


def environment(device: str) -> dict[str, Any]:
    """Device, versions and thread counts, for the report header and the JSON."""
    import lightning
    import torchvision

    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = f"{cpu_name()} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads, {cpu_bf16_text()})"
    return {"device": device, "device_name": name, "cpu_count": os.cpu_count(),
            "cpu_capability": cpu_capability(), "cpu_native_bf16": cpu_computes_bf16_natively(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "torchvision": torchvision.__version__, "lightning": lightning.__version__,
            "cuda": torch.version.cuda if device == "cuda" else None, "python": platform.python_version(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def cpu_bf16_text() -> str:
    """Whether this CPU's bf16 rows ran on torch's fast kernels, for the header (``bf16-*`` rows are slow without)."""
    if cpu_computes_bf16_natively():
        return f"{cpu_capability()}, native bf16"
    return (f"{cpu_capability()}, no native bf16: its bf16 rows take slow paths and trainer.precision=auto runs "
            "32-true here")


def ratio_text(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """``value`` formatted, or ``-`` when there is none (a failed row, a zero baseline)."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def previous_ratio_text(row: Mapping[str, Any], key: str) -> str:
    """Ratio ``key`` of ``row`` against the row above it (``vs_previous``), or ``-`` for the first row."""
    return ratio_text((row.get("vs_previous") or {}).get(key), suffix="x")


def each_repeat_text(row: Mapping[str, Any], text_of: Callable[[Mapping[str, Any]], str]) -> str:
    """``text_of`` each of a row's repeats, in run order, joined by `` / `` (the row itself for a single run)."""
    return " / ".join(text_of(repeat) for repeat in row.get("repeat_results") or [row])


def repeat_text(row: Mapping[str, Any], prefix: str, spec: str = ".0f") -> str:
    """``min-max (±x %)`` of a row's repeat medians for timing ``prefix``; ``-`` for a single run."""
    medians = row.get(f"{prefix}_ms_repeat_medians") or []
    if len(medians) < 2:
        return "-"
    low, high = row[f"{prefix}_ms_repeat_min"], row[f"{prefix}_ms_repeat_max"]
    return f"{low:{spec}}-{high:{spec}} ({100 * row[f'{prefix}_ms_repeat_spread']:.0f} %)"


def roofline_text(row: Mapping[str, Any]) -> str:
    """``achieved GFLOP/s (x % of the row's dtype's peak)``, or ``-`` where there is no figure."""
    if row.get("achieved_gflops") is None:
        return "-"
    fraction = row.get("peak_fraction")
    share = f" ({100 * fraction:.0f} % {row['compute_dtype']})" if fraction is not None else ""
    text = f"{row['achieved_gflops']:.0f}{share}"
    if row.get("model_achieved_gflops") is not None:  # a row that executes fewer FLOPs than the model defines
        model_fraction = row.get("model_peak_fraction")
        model_share = f" ({100 * model_fraction:.0f} %)" if model_fraction is not None else ""
        text += f"; model FLOPs {row['model_achieved_gflops']:.0f}{model_share}"
    return text


def state_line(setting: Setting, state: Mapping[str, Any] | None) -> str:
    """The header line that says which weights every row loaded, and the learning rate of timed steps."""
    if state is None:
        return ("- model state: random (the seeded initialisation, the same in every row); timed training steps "
                "run the recipe's warm-up schedule from step 0")
    origin = "cached" if state.get("cached") else f"made for this run in {state['make_s']:.0f} s"
    return (f"- model state: trained, loaded by every row and repeat: {state['recipe']}; loss "
            f"{state['loss_first']:.2f} -> {state['loss_last']:.2f}; weights sha256 {state['weights_sha256'][:12]} "
            f"({origin}: `{state['file']}`); timed training steps start a fresh optimizer at the constant lr the "
            f"state's schedule ended at, {state['final_lr']:.3g}")


def repeats_line(run: Mapping[str, Any]) -> str:
    """The header line that says how often and in which order the rows ran."""
    order = ("interleaved, rows in table order every round" if run.get("order_seed") is None
             else f"shuffled every round (seed {run['order_seed']})")
    return (f"- repeats: {run['repeats']} per row, each a fresh process, {order}; times are the median over "
            f"repeats of each repeat's median, `repeats` gives the min-max of the repeat medians (and "
            f"(max - min) / median)")


def peaks_line(peaks: Mapping[str, Any]) -> str:
    """The header line that names the peaks the roofline column divides by, and where they came from."""
    parts = []
    for dtype, peak in peaks["peaks"].items():
        how = "measured now" if dtype in peaks["measured"] else f"cached, measured {peak['measured_at']}"
        if peak.get("busy_cpus") is not None:
            how += f" with {peak['busy_cpus']:.1f} CPUs busy with other work: a low peak, not cached"
        tf32 = ", TF32" if peak.get("tf32") else ""
        probes = (f"{peak['n']}x{peak['n']} matmul {peak['matmul_gflops']:.0f}{tf32}, 3x3 conv 2x256x64x64 "
                  f"{peak['conv_gflops']:.0f}") if "conv_gflops" in peak else f"{peak['n']}x{peak['n']} matmul{tf32}"
        parts.append(f"{dtype} {peak['gflops']:.0f} GFLOP/s (the faster of: {probes}; best of {peak['runs']}, {how})")
    return (f"- roofline: GFLOP per step counted once per row with FlopCounterMode (matmuls and convolutions); "
            f"% of peak vs this machine's {'; '.join(parts)}; fp32 rows vs the fp32 peak, mixed rows vs their "
            f"low-precision peak; peaks cached in `{peaks['file']}` under `{peaks['key']}`; a row that executes fewer "
            f"FLOPs than the model defines (Winograd convolutions) also gives its model FLOPs (the same step counted "
            f"with direct convolutions) per second and their % of the peak (model FLOPs utilisation)")


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
                 command: str, out: Path, run: Mapping[str, Any] | None = None) -> str:
    """Adds to each ok row its ratios to the first ok row, and as ``vs_previous`` its ratios to the ok row above it
    (``None`` for the first: what that row's own switch changed, since the rows are cumulative); writes
    ``bench_<kind>.{md,json,png}`` to ``out``.

    ``run``: the state, the peaks, the repeats and the run order (see :func:`lit_amp_det.bench.e2e.main`), for
    the header and the JSON's top level. Returns the markdown table.
    """
    base = next((row for row in rows if row["status"] == "ok"), None)
    previous = None
    for row in rows:
        if row["status"] != "ok":
            continue
        row.update(bench.ratios(row, base))
        row["vs_previous"] = None if previous is None else bench.ratios(row, previous)
        previous = row
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
        half_line(bench, setting),
        *_load_line(env),
        *([state_line(setting, run.get("state")), repeats_line(run), peaks_line(run["peaks"])] if run else []),
        f"- ratios vs {base_label} (from the median times); `vs row above`: the same ratio against the row above "
        f"that ran, the effect of the switches that row adds (rows are cumulative); IQR = interquartile range of the "
        f"timed steps of all repeats; peak = memory one step needed above the built model ({_memory_method(rows)})",
    ]
    text = table(bench, rows, header)
    text = "\n".join([text, *breakdown_lines(rows, (run or {}).get("peaks", {}).get("peaks", {}))])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"bench_{bench.kind}.md").write_text(text + "\n")
    with open(out / f"bench_{bench.kind}.json", "w") as f:
        json.dump({"kind": bench.kind, "command": command, "setting": asdict(setting), "environment": env,
                   **(run or {}), "rows": rows}, f, indent=2)
    plot(bench, rows, f"bench {bench.kind}: {setting.model}, batch {setting.batch}, {setting.size}, "
         f"{env['device_name']}", out / f"bench_{bench.kind}.png")
    return text


def half_line(bench: Bench, setting: Setting) -> str:
    """The header line that says in which precision the precision rows ran, and which rows fp32 leaves out."""
    half = setting_half(setting)
    text = (f"- precision rows in {half} (`--precision`; `{mixed_precision(setting.device, half)}` for autocast, "
            f"`{low_precision_weights(setting.device, half)}` for half weights)")
    if half != "fp32":
        fp32_only = ", ".join(row.name for row in bench.rows if row.needs_fp32)
        if not fp32_only:
            return text
        return f"{text}; the rows that act in fp32 only ({fp32_only}) run only when `--rows` names them"
    skipped = ", ".join(row.name for row in bench.rows if row.needs_half)
    return (f"{text}: the rows that change nothing in fp32 ({skipped}) run only when `--rows` names them; "
            f"every row is an fp32 recipe")


def _load_line(env: dict[str, Any]) -> list[str]:
    """The 1-minute load average before and after: other processes on the cores make CPU timings unreliable."""
    if not env.get("load_average"):
        return []
    after = env.get("load_average_after", env["load_average"])
    return [f"- 1-min load average before / after the rows: {env['load_average'][0]:.1f} / {after[0]:.1f} on "
            f"{env['cpu_count']} cores (after includes the rows themselves; other work on the cores skews timings)"]


def _memory_method(rows: Sequence[dict[str, Any]]) -> str:
    return next((row["memory_method"] for row in rows if row.get("memory_method")), "n/a")

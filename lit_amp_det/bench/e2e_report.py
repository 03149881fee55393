"""The report of ``bench train`` and ``bench infer``: header, markdown table, JSON and bar plot of the rows."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lit_amp_det.bench.e2e_rows import Bench, Setting

__all__ = ["environment", "plot", "ratio_text", "table", "write_report"]


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

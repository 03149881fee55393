"""One table and one plot per Hydra sweep: accuracy against speed and memory, job by job.

A multirun leaves one directory per job. :class:`SweepSummary`, a Hydra callback, writes
``summary.{csv,md,png}`` into the sweep directory after each job and when the sweep ends;
:func:`summarize_sweep` does the same from a notebook, and :func:`collect_rows` only reads. A job that crashed
or whose ``metrics.json`` is missing or broken gets a row with its status instead of stopping the summary;
under submitit, a failed job's row names its logs.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import importlib.util
import io
import json
import logging
import math
import os
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

__all__ = ["SweepSummary", "collect_rows", "summarize_sweep", "FAILURE_FILE", "STATUSES"]

log = logging.getLogger(__name__)

#: What a job's row says: metrics read; the job raised; no metrics.json; metrics.json is not valid JSON.
STATUSES = ("ok", "failed", "missing", "unreadable")
#: Written into a job directory by :meth:`SweepSummary.on_job_end` when the job raised: the error, and under
#: submitit a second line naming the job's submitit logs (the traceback is in the ``.err`` one).
FAILURE_FILE = "failure.txt"

# summary column -> key of metrics.json's "perf" record
_PERF = {
    "images_per_s": "train_images_per_s",
    "step_ms": "train_step_ms_median",
    "peak_memory_mb": "peak_memory_mb",
    "step_memory_mb": "step_memory_mb",
    "tensor_memory_mb": "tensor_memory_mb",
}
_NAN = float("nan")


def _job_dirs(sweep_dir: Path) -> list[Path]:
    """Subdirectories holding a Hydra job (``.hydra/``) or its ``metrics.json``, numbered ones first, in job
    order.
    """
    jobs = [
        p
        for p in sweep_dir.iterdir()
        if p.is_dir() and ((p / ".hydra").is_dir() or (p / "metrics.json").is_file())
    ]
    return sorted(jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def _read_overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    try:
        overrides = yaml.safe_load(path.read_text()) if path.is_file() else []
    except (OSError, yaml.YAMLError) as err:
        log.warning("sweep summary: cannot read %s (%s); the job's overrides are left empty", path, err)
        return []
    return [str(o) for o in overrides] if isinstance(overrides, list) else []


def _split_override(override: str) -> tuple[str, str]:
    """``+model.x=1`` -> ``("model.x", "1")``; a deletion ``~callbacks.x`` -> ``("callbacks.x",
    "<deleted>")``.
    """
    key, sep, value = override.partition("=")
    return key.lstrip("+~"), (value if sep else "<deleted>")


def _number(value: Any) -> float:
    """A float for the table; NaN for anything absent or not numeric (an empty cell in CSV and markdown)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _NAN
    return float(value)


def _read_job(job_dir: Path) -> dict[str, Any]:
    """Status, error text, metrics and perf of one job directory (never raises on bad job files)."""
    row: dict[str, Any] = {"status": "ok", "error": "", "metrics": {}, "perf": {}, "time_s": _NAN}
    path = job_dir / "metrics.json"
    failure = job_dir / FAILURE_FILE
    if failure.is_file():
        row.update(status="failed", error=failure.read_text(errors="replace").strip() or "the job raised")
        if not path.is_file():
            return row
    elif not path.is_file():
        row.update(status="missing", error=f"no metrics.json in {job_dir} (the job did not finish)")
        return row
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise ValueError(f"top level is a {type(record).__name__}, expected an object")
    except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        log.warning("sweep summary: %s is not readable JSON (%s); its row is marked unreadable", path, err)
        row.update(status="unreadable", error=f"{path.name}: {err}")
        return row
    row.update(
        {key: record[key] for key in ("metrics", "perf") if isinstance(record.get(key), dict)},
        time_s=_number(record.get("time_s")),
    )
    return row


def collect_rows(sweep_dir: Path, metric: str | None) -> list[dict[str, Any]]:
    """One row per job of ``sweep_dir``, in job order, all with the same keys in column order. Columns:
    ``job``, ``status`` (one of :data:`STATUSES`), ``overrides`` (as one string), one column per overridden
    key, ``objective`` (the value of ``metric``), every metric whose name contains ``mAP``, ``images_per_s``,
    ``step_ms``, ``peak_memory_mb``, ``step_memory_mb``, ``tensor_memory_mb``, ``device``, ``time_s``,
    ``error``. Absent numbers are NaN, absent text is ``""``.
    """
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(
            f"sweep directory {sweep_dir} does not exist; pass the folder of a multirun, "
            f"${{paths.runs_root}}/multirun/<timestamp> (runs/multirun/... by default)"
        )
    jobs = []
    for job_dir in _job_dirs(sweep_dir):
        overrides = _read_overrides(job_dir)
        jobs.append((job_dir, overrides, dict(_split_override(o) for o in overrides), _read_job(job_dir)))
    override_keys = list(dict.fromkeys(k for _, _, pairs, _ in jobs for k in pairs))
    map_keys = sorted({k for *_, job in jobs for k in job["metrics"] if "mAP" in k})
    rows = []
    for job_dir, overrides, pairs, job in jobs:
        metrics, perf = job["metrics"], job["perf"]
        rows.append(
            {
                "job": int(job_dir.name) if job_dir.name.isdigit() else job_dir.name,
                "status": job["status"],
                "overrides": " ".join(overrides),
                **{key: pairs.get(key, "") for key in override_keys},
                "objective": _number(metrics.get(metric)) if metric else _NAN,
                **{key: _number(metrics.get(key)) for key in map_keys},
                **{column: _number(perf.get(key)) for column, key in _PERF.items()},
                "device": str(perf.get("device") or ""),
                "time_s": job["time_s"],
                "error": job["error"],
            }
        )
    return rows


def _columns_between(rows: Sequence[dict[str, Any]], first: str, last: str) -> list[str]:
    keys = list(rows[0]) if rows else []
    return keys[keys.index(first) + 1 : keys.index(last)] if keys else []


def _varying_keys(rows: Sequence[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
    """Override keys whose value differs between jobs, and the ``key: value`` pairs all jobs share."""
    keys = _columns_between(rows, "overrides", "objective")
    varying = [k for k in keys if len({r[k] for r in rows}) > 1]
    return varying, {k: rows[0][k] for k in keys if k not in varying}


def _short_value(value: str) -> str:
    """``0.00019182157424526137`` -> ``0.000192``: Optuna's floats, readable in labels and markdown."""
    try:
        number = float(value)
    except ValueError:
        return value
    return f"{number:.3g}" if any(c in value for c in ".eE") else value


def _label(row: dict[str, Any], varying: Sequence[str]) -> str:
    """``#2 precision=bf16-mixed callbacks=fast``: the last part of each dotted key, unless that is
    ambiguous.
    """
    tails = [k.rsplit(".", 1)[-1] for k in varying]
    names = [tail if tails.count(tail) == 1 else key for key, tail in zip(varying, tails)]
    pairs = [f"{n}={_short_value(str(row[k]))}" for n, k in zip(names, varying) if row[k] != ""]
    return " ".join([f"#{row['job']}", *pairs])


def _cell(value: Any, digits: int | None) -> str:
    if isinstance(value, float) and digits is not None:
        return "" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _markdown(rows: Sequence[dict[str, Any]], sweep_dir: Path, metric: str | None) -> str:
    """The table of :func:`collect_rows` for people: varying overrides only, no per-size mAP columns."""
    varying, common = _varying_keys(rows)
    maps = [
        k
        for k in _columns_between(rows, "objective", "images_per_s")
        if not k.endswith(("_small", "_medium", "_large"))
    ]
    # (column, decimals): None for text, left-aligned; numbers are right-aligned
    columns = [
        ("job", None),
        ("status", None),
        *((k, None) for k in varying),
        ("objective", 4),
        *((k, 4) for k in maps),
        ("images_per_s", 1),
        ("step_ms", 1),
        ("peak_memory_mb", 0),
        ("step_memory_mb", 0),
        ("tensor_memory_mb", 0),
        ("time_s", 1),
    ]
    if any(r["error"] for r in rows):
        columns.append(("error", None))
    counts = ", ".join(f"{n} {s}" for s in STATUSES if (n := sum(r["status"] == s for r in rows)))
    lines = [
        f"# Sweep summary: `{sweep_dir}`",
        "",
        f"{len(rows)} jobs ({counts or 'none found'}); objective = `{metric or 'not set'}` "
        f"(the config's `optimized_metric`).",
        "",
    ]
    if scored := [r for r in rows if not math.isnan(r["objective"])]:
        best = max(scored, key=lambda r: r["objective"])
        lines += [f"Highest `{metric}`: {best['objective']:.4f}, job {_label(best, varying)}.", ""]
    if any(str(r.get("device", "")).startswith("cpu") for r in rows):
        lines += [
            "On a CPU, `peak_memory_mb` is the process's resident set, shared by a sweep's jobs, so it "
            "depends on job order; compare settings by `tensor_memory_mb` (parameters, gradients, optimizer "
            "state and the activations saved for backward of one step), which does not, and which the plot "
            "uses.",
            "",
        ]
    if common:
        lines += ["Overrides shared by all jobs: " + " ".join(f"`{k}={v}`" for k, v in common.items()), ""]
    lines.append("| " + " | ".join(name for name, _ in columns) + " |")
    lines.append("|" + "|".join("---" if digits is None else "---:" for _, digits in columns) + "|")
    for row in rows:
        shown = {**row, **{k: _short_value(str(row[k])) for k in varying}}  # full values stay in summary.csv
        lines.append("| " + " | ".join(_cell(shown[name], digits) for name, digits in columns) + " |")
    return "\n".join(lines) + "\n"


def _csv(rows: Sequence[dict[str, Any]]) -> str:
    out = io.StringIO()
    if rows:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(
            {k: "" if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in rows
        )
    return out.getvalue()


def _plot(rows: Sequence[dict[str, Any]], metric: str | None, title: str, path: Path) -> None:
    """Two panels: objective vs. train images/s and vs. memory (tensor total on a CPU, peak on a GPU). Points
    carry job numbers that the legend maps to varying overrides (labels by points overlap); a job has one
    colour and marker.
    """
    from matplotlib.figure import Figure  # no pyplot: renders with Agg and never touches the global backend
    from matplotlib.lines import Line2D

    varying, _ = _varying_keys(rows)
    style = {id(r): {"color": f"C{i % 10}", "marker": "os^Dv"[i // 10 % 5]} for i, r in enumerate(rows)}
    fig = Figure(figsize=(13, 5.5 + 0.2 * len(rows) / 2), layout="constrained")
    # a CPU's resident-set peak ranks a sweep's jobs by their order; the tensor total does not
    on_cpu = any(str(r.get("device", "")).startswith("cpu") for r in rows)
    memory = (
        ("tensor_memory_mb", "training tensors MB (lower is better)")
        if on_cpu
        else ("peak_memory_mb", "peak memory MB (lower is better)")
    )
    for ax, column, xlabel in zip(
        fig.subplots(1, 2), ("images_per_s", memory[0]), ("train images/s (higher is better)", memory[1])
    ):
        points = [r for r in rows if not math.isnan(r[column]) and not math.isnan(r["objective"])]
        for row in points:
            ax.scatter(row[column], row["objective"], s=40, **style[id(row)])
            ax.annotate(
                f"#{row['job']}",
                (row[column], row["objective"]),
                xytext=(5, 3),
                textcoords="offset points",
                fontsize=8,
            ).set_in_layout(False)
        if not points:
            ax.text(
                0.5,
                0.5,
                f"no job has both {metric or 'an objective'} and {column} (metrics.json 'perf')",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
        ax.margins(0.12)
        ax.set(xlabel=xlabel, ylabel=metric or "objective")
        ax.grid(True, alpha=0.3)
    handles = [
        Line2D([], [], linestyle="", label=_label(r, varying), **style[id(r)])
        for r in rows
        if not math.isnan(r["objective"])
    ]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=min(3, len(handles)), fontsize=8)
    fig.suptitle(f"{metric or 'objective'} per job of {title}", fontsize=10)
    fig.savefig(path, format="png", dpi=110)


def _write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Writes through a temporary file in the same folder and renames it: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def summarize_sweep(sweep_dir: Path, metric: str | None) -> list[dict[str, Any]]:
    """Writes ``summary.csv``, ``summary.md`` and (with matplotlib) ``summary.png`` into ``sweep_dir``;
    returns the rows. ``metric`` is the objective column (the config's ``optimized_metric``).
    """
    sweep_dir = Path(sweep_dir)
    rows = collect_rows(sweep_dir, metric)
    if not rows:
        log.warning("sweep summary: no job directories (with .hydra/ or metrics.json) in %s", sweep_dir)
    _write_atomic(sweep_dir / "summary.csv", lambda p: p.write_text(_csv(rows)))
    _write_atomic(sweep_dir / "summary.md", lambda p: p.write_text(_markdown(rows, sweep_dir, metric)))
    if importlib.util.find_spec("matplotlib") is None:
        log.warning("sweep summary: matplotlib is not installed, so no summary.png; `pip install matplotlib`")
    else:
        _write_atomic(sweep_dir / "summary.png", lambda p: _plot(rows, metric, str(sweep_dir), p))
    return rows


class SweepSummary(Callback):
    """Hydra callback: keeps ``summary.{csv,md,png}`` of the sweep directory current, job by job. Hydra calls
    ``on_multirun_end`` only when the sweep did not fail, so :meth:`on_job_end` records a failure in the job
    directory (:data:`FAILURE_FILE`) and refreshes the summary after each job of a multirun;
    ``on_multirun_end`` writes the final one and prints it, with every job that did not finish named on stderr
    (its overrides, error and logs). A sweep stopped by a failed job gets the same as the command exits.
    Single runs are left alone. A problem while summarising is logged, never raised: a sweep must not fail, or
    hide a job's own error, because of its report.
    """

    _open_sweep: DictConfig | None = None  # the config of a sweep that has not reached on_multirun_end
    _exit_registered = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not self._exit_registered:  # one exit report per callback, however many sweeps a process runs
            atexit.register(self._at_exit)
            self._exit_registered = True
        self._open_sweep = config

    def _at_exit(self) -> None:
        config = self._open_sweep
        if config is not None and (sweep := Path(str(config.hydra.sweep.dir))).is_dir() and _job_dirs(sweep):
            self._summarize(config, final=True)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.get("mode") != RunMode.MULTIRUN:
            return
        if job_return.status == JobStatus.FAILED:
            _record_failure(Path(config.hydra.runtime.output_dir), job_return)
        self._summarize(config, final=False)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._open_sweep = None
        self._summarize(config, final=True)

    @staticmethod
    def _summarize(config: DictConfig, final: bool) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            rows = summarize_sweep(sweep_dir, config.get("optimized_metric"))
        except Exception as err:  # noqa: BLE001 -- see the class docstring
            log.warning("sweep summary of %s failed: %s: %s", sweep_dir, type(err).__name__, err)
            return
        if final:
            print((sweep_dir / "summary.md").read_text(), flush=True)
            for row in (r for r in rows if r["status"] != "ok"):
                error = row["error"].replace("\n", "\n  ")
                print(
                    f"sweep job {row['job']} {row['status']} ({row['overrides']}):\n  {error}",
                    file=sys.stderr,
                    flush=True,
                )
        done = "" if final else f" (jobs so far: {len(rows)})"
        print(f"sweep summary{done}: {sweep_dir}/summary.{{csv,md,png}}", flush=True)


def _record_failure(job_dir: Path, job_return: JobReturn) -> None:
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # it also prints what the sweeper prints again later
            _ = job_return.return_value  # the public way to the exception: it re-raises it
    except Exception as err:  # noqa: BLE001 -- whatever the job raised is what we record
        error = f"{type(err).__name__}: {err}"
        if (
            logs := _submitit_logs()
        ):  # the sweep's process gets the exception without its traceback: log it here
            traceback.print_exception(err)
            error += "\nsubmitit log: " + " ".join(logs)
    else:
        error = "the job failed"
    try:
        _write_atomic(job_dir / FAILURE_FILE, lambda p: p.write_text(error + "\n"))
    except OSError as err:
        log.warning("sweep summary: cannot record the failure in %s (%s)", job_dir, err)


def _submitit_logs() -> list[str]:
    """This process's submitit log files (stderr, stdout) when it runs as a submitit job; else none."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return []
    try:
        import submitit

        paths = submitit.JobEnvironment().paths
        return [str(p) for p in (paths.stderr, paths.stdout) if p.is_file()]
    except Exception:  # noqa: BLE001 -- a report must never fail the job's return
        return []

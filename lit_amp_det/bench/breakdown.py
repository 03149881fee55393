"""Where a step's time goes: the FLOP ops (matrix products, convolutions) against everything else.

The roofline column says how far a row is from the device's peak; this says why. One more step of the row, after
the timed ones, runs under :mod:`torch.profiler`, and every op's *self* time (time in the op minus the ops it
called: on a CPU the calling thread's wall time, which covers the op's worker threads; on CUDA its kernels' device
time) is put in one of two bins:

* **FLOP ops**: the ops :class:`~torch.utils.flop_counter.FlopCounterMode` counts FLOPs for (``mm``, ``addmm``,
  ``bmm``, ``baddbmm`` and the convolutions, forward and backward). Their GFLOP/s (the row's FLOPs over the time in
  them) is how well the kernels themselves use the hardware;
* **other ops**: copies and casts, elementwise maths, norms, RoIAlign, NMS, the optimizer's update. They do no
  counted FLOPs, so their time is what separates the FLOP ops' rate from the whole step's.

What no op accounts for (Python, the autograd engine's bookkeeping, the profiler's own overhead) is the profiled
step's wall time minus the two bins. JSON per row: ``flop_ops_ms``, ``other_ops_ms``, ``profiled_step_ms``,
``flop_ops_share``, ``flop_ops_gflops`` and ``top_other_ops`` (the five largest other ops, ms each).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lit_amp_det.bench.roofline import IN_PLACE_PRODUCTS
from lit_amp_det.profiling import timed

__all__ = ["FLOP_OPS", "breakdown_lines", "display_name", "is_flop_op", "split_self_times", "time_breakdown"]

#: Matrix-product ops the roofline counts FLOPs for (convolutions are matched by name, see :func:`is_flop_op`),
#: the in-place ones included (:data:`lit_amp_det.bench.roofline.IN_PLACE_PRODUCTS`).
FLOP_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"}
                     | {f"aten::{name}" for name in IN_PLACE_PRODUCTS})
#: Prefix of the autograd wrapper ``torch.library.register_autograd`` generates for an op.
_AUTOGRAD_WRAPPER = "GeneratedBackwardFor_"
#: The convolutions' entry points whose names lack "convolution" (``conv2d``, ``conv_transpose2d``, ...).
_CONV_ENTRY = re.compile(r"aten::conv(\dd|_transpose\dd)$")


def is_flop_op(name: str) -> bool:
    """True for the matrix products and every convolution op (forward, backward, mkldnn/cudnn/slow variants, and
    the oneDNN ops ``torch.compile`` emits on a CPU)."""
    return (name in FLOP_OPS or "convolution" in name or _CONV_ENTRY.match(name) is not None
            or name.endswith("_linear_pointwise") or name == "mkl::_mkl_linear")


def display_name(name: str) -> str:
    """An op's name for the report: ``aten::`` dropped; a ``torch.library.register_autograd`` wrapper
    (``GeneratedBackwardFor_<op>``), whose self time in a training step is the op's *forward* kernel (the profiler
    records the kernel it calls below autograd under the wrapper), named as the op's forward."""
    if name.startswith(_AUTOGRAD_WRAPPER):
        return f"{name.removeprefix(_AUTOGRAD_WRAPPER)} forward"
    return name.removeprefix("aten::")


def split_self_times(events: Sequence[Any], device: str) -> tuple[float, dict[str, float]]:
    """``(ms in FLOP ops, {other op: ms})`` from profiler ``key_averages()`` entries (self times)."""
    attribute = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    flop_ms, other = 0.0, {}
    for event in events:
        ms = getattr(event, attribute, 0.0) / 1000.0
        if ms <= 0:
            continue
        if is_flop_op(event.key):
            flop_ms += ms
        else:
            other[event.key] = other.get(event.key, 0.0) + ms
    return flop_ms, other


def time_breakdown(step: Callable[[], Any], device: str, gflop_per_step: float | None, top: int = 5) -> dict[str, Any]:
    """Runs ``step`` once under the profiler; the FLOP ops' and the other ops' share of it (see the module doc)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device == "cuda" else [])]
    with profile(activities=activities) as prof:
        wall_ms = 1000 * timed(step, device)
    flop_ms, other = split_self_times(prof.key_averages(), device)
    largest = dict(sorted(other.items(), key=lambda item: -item[1])[:top])
    return {
        "profiled_step_ms": wall_ms,
        "flop_ops_ms": flop_ms,
        "other_ops_ms": sum(other.values()),
        "flop_ops_share": flop_ms / wall_ms if wall_ms > 0 else None,
        "flop_ops_gflops": gflop_per_step / (flop_ms / 1000) if gflop_per_step and flop_ms > 0 else None,
        "top_other_ops": largest,
    }


def breakdown_lines(rows: Sequence[Mapping[str, Any]], peaks: Mapping[str, Any]) -> list[str]:
    """The report's "where the time goes" table, one line per row that has a breakdown (empty without any)."""
    measured = [row for row in rows if row.get("status") == "ok" and row.get("flop_ops_ms") is not None]
    if not measured:
        return []
    lines = ["", "Where the time of one profiled step goes (`lit_amp_det.bench.breakdown`): self time in the FLOP ops "
             "(matmuls, convolutions) and their GFLOP/s against the peak, other ops, and what no op accounts for "
             "(Python, autograd, profiler).", "",
             "| # | row | profiled step ms | FLOP ops ms (share) | FLOP ops GFLOP/s (% of peak) | other ops ms | "
             "unaccounted ms | largest other ops (ms) |", "|---|---|---|---|---|---|---|---|"]
    for number, row in enumerate(rows, 1):
        if row not in measured:
            continue
        peak = peaks.get(row.get("compute_dtype"), {}).get("gflops")
        rate = row.get("flop_ops_gflops")
        rate_text = "-" if rate is None else f"{rate:.0f}" + (f" ({100 * rate / peak:.0f} %)" if peak else "")
        unaccounted = row["profiled_step_ms"] - row["flop_ops_ms"] - row["other_ops_ms"]
        others = ", ".join(f"{display_name(name)} {ms:.0f}" for name, ms in row["top_other_ops"].items())
        lines.append(f"| {number} | {row['label']} | {row['profiled_step_ms']:.0f} | {row['flop_ops_ms']:.0f} "
                     f"({100 * row['flop_ops_share']:.0f} %) | {rate_text} | {row['other_ops_ms']:.0f} | "
                     f"{unaccounted:.0f} | {others} |")
    return lines

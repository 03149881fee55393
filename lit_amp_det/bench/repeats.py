"""Repeated rows: the order they run in, and one row's figures from its repeats.

A bench on a shared or throttled machine reads slower for whatever runs first or last, so each row runs
``repeats`` times, every time in a fresh process, in rounds: every round runs each row once, and each round
starts one row further down the table (A B C, B C A, C A B, ...), so that no row always runs first. A row's
headline time is the median over its repeats of each repeat's median step time: a repeat disturbed by other
work moves one repeat median, not the figure. The spread of the repeat medians (their range over their median)
says how far a figure can be trusted. Running the processes is the caller's job; this module only orders and
aggregates, so it is tested without processes.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["aggregate", "run_order", "run_repeats"]


def run_order(rows: int, repeats: int) -> list[tuple[int, int]]:
    """``(round, row index)`` in the order the runs happen (see the module doc)."""
    if rows < 1 or repeats < 1:
        raise ValueError(f"run_order needs rows >= 1 and repeats >= 1, got rows={rows}, repeats={repeats}")
    return [(round_, (round_ + k) % rows) for round_ in range(repeats) for k in range(rows)]


def run_repeats(
    order: Sequence[tuple[int, int]], run: Callable[[int, int, int], dict[str, Any]], rows: int
) -> list[list[dict[str, Any]]]:
    """Calls ``run(row, round, position)`` for each entry of ``order``; each row's results in run order, with
    ``round`` and ``position`` (from 0) added. A row that fails once is reported failed: its later repeats are
    skipped.
    """
    results: list[list[dict[str, Any]]] = [[] for _ in range(rows)]
    for position, (round_, row) in enumerate(order):
        if not any(r.get("status") == "failed" for r in results[row]):
            results[row].append({**run(row, round_, position), "round": round_, "position": position})
    return results


def aggregate(repeats: Sequence[dict[str, Any]], timings: Sequence[str]) -> dict[str, Any]:
    """One row from the results of its repeats (each with ``<timing>_ms_median`` and ``<timing>_ms_all``): for
    each timing ``t``, ``t_ms_median`` is the median of the repeats' medians, ``t_ms_repeat_medians`` lists
    them in run order, ``t_ms_repeat_spread`` is their ``(max - min) / median`` and ``t_ms_all`` pools every
    timed step. Other numbers are the median over repeats (the value itself where all agree); anything else is
    the first repeat's. A row with a failed repeat is that failed result. ``repeat_results`` keeps every
    repeat as run.
    """
    if not repeats:
        raise ValueError("aggregate needs at least one repeat's result")
    if failed := [r for r in repeats if r.get("status") == "failed"]:
        return {**failed[0], "repeats": len(repeats), "repeat_results": list(repeats)}
    row: dict[str, Any] = {}
    for key, value in repeats[0].items():
        values = [r.get(key) for r in repeats]
        numbers = (
            all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
            and len(set(values)) > 1
        )
        row[key] = statistics.median(values) if numbers else value
    for timing in timings:
        medians = [r[f"{timing}_ms_median"] for r in repeats]
        middle = statistics.median(medians)
        row.update(
            {
                f"{timing}_ms_median": middle,
                f"{timing}_ms_repeat_medians": medians,
                f"{timing}_ms_repeat_spread": (max(medians) - min(medians)) / middle if middle > 0 else 0.0,
                f"{timing}_ms_all": [ms for r in repeats for ms in r[f"{timing}_ms_all"]],
            }
        )
    for key in ("round", "position"):
        row.pop(key, None)
    return {**row, "repeats": len(repeats), "repeat_results": list(repeats)}

"""Repeated rows: the order they run in, and one row's figures from its repeats.

A bench on a shared or thermally throttled machine reads slower for whatever runs first or last, so each row
runs ``repeats`` times, every time in a fresh process, in rounds: every round runs each row once, in table
order (interleaved: A B C A B C ...) or in a new random order per round (``seed``). A row's headline time is
the median over its repeats of each repeat's median step time: a repeat disturbed by other work on the
machine moves one of the repeat medians, not the figure. The spread across repeats (their min, max and range
relative to the median) says how far a figure can be trusted. Running the processes is the caller's job;
this module only orders and aggregates, so it is tested without processes.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["aggregate", "pooled_quartiles", "run_order", "run_repeats"]


def run_order(rows: int, repeats: int, seed: int | None = None) -> list[tuple[int, int]]:
    """``(round, row index)`` in the order the runs happen: ``repeats`` rounds of ``rows`` rows each.

    ``seed=None``: every round in table order (A B C A B C ...). A seed: each round a fresh permutation drawn
    from ``random.Random(seed)``, the same for the same seed.
    """
    if rows < 1 or repeats < 1:
        raise ValueError(f"run_order needs rows >= 1 and repeats >= 1, got rows={rows}, repeats={repeats}")
    rng = random.Random(seed) if seed is not None else None
    order = []
    for round_ in range(repeats):
        indices = list(range(rows))
        if rng is not None:
            rng.shuffle(indices)
        order += [(round_, index) for index in indices]
    return order


def run_repeats(order: Sequence[tuple[int, int]], run: Callable[[int, int, int], dict[str, Any]],
                rows: int) -> list[list[dict[str, Any]]]:
    """Calls ``run(row, round, position)`` for each entry of ``order``; returns each row's results in run order.

    Each result gets ``round`` and ``position`` (its place in the whole run, from 0). Once a row has a result
    with ``status: failed`` its later repeats are skipped: a row that fails once is reported failed.
    """
    results: list[list[dict[str, Any]]] = [[] for _ in range(rows)]
    for position, (round_, row) in enumerate(order):
        if any(r.get("status") == "failed" for r in results[row]):
            continue
        result = run(row, round_, position)
        results[row].append({**result, "round": round_, "position": position})
    return results


def pooled_quartiles(ms: Sequence[float]) -> tuple[float, float]:
    """First and third quartile (inclusive method) of ``ms``; both the value itself for a single one."""
    if len(ms) == 1:
        return ms[0], ms[0]
    q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
    return q1, q3


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def aggregate(repeats: Sequence[dict[str, Any]], timings: Sequence[str]) -> dict[str, Any]:
    """One row from the results of its repeats (each as :func:`lit_amp_det.bench.e2e_rows.summarise` reports).

    For each timing prefix ``p``: ``p_ms_median`` is the median of the repeats' ``p_ms_median``;
    ``p_ms_repeat_medians`` lists them in run order, ``p_ms_repeat_min``/``_max`` bound them and
    ``p_ms_repeat_spread`` is ``(max - min) / median``; ``p_ms_all`` pools every timed step of every repeat,
    and ``p_ms_q1``/``_q3``/``_iqr``/``_min``/``_max`` keep their meaning over those pooled steps. Other
    numbers are the median over repeats (the value itself where all agree); anything else is the first
    repeat's. A row with a failed repeat is that failed result. ``repeat_results`` keeps every repeat as run.
    """
    if not repeats:
        raise ValueError("aggregate needs at least one repeat's result")
    failed = [r for r in repeats if r.get("status") == "failed"]
    if failed:
        return {**failed[0], "repeats": len(repeats), "repeats_ok": len(repeats) - len(failed),
                "repeat_results": list(repeats)}
    first = repeats[0]
    row: dict[str, Any] = {}
    for key, value in first.items():
        values = [r.get(key) for r in repeats]
        if _is_number(value) and all(_is_number(v) for v in values):
            row[key] = value if len(set(values)) == 1 else statistics.median(values)
        else:
            row[key] = value
    for prefix in timings:
        medians = [r[f"{prefix}_ms_median"] for r in repeats]
        pooled = [ms for r in repeats for ms in r[f"{prefix}_ms_all"]]
        q1, q3 = pooled_quartiles(sorted(pooled))
        middle = statistics.median(medians)
        row.update({
            f"{prefix}_ms_median": middle,
            f"{prefix}_ms_q1": q1, f"{prefix}_ms_q3": q3, f"{prefix}_ms_iqr": q3 - q1,
            f"{prefix}_ms_min": min(pooled), f"{prefix}_ms_max": max(pooled), f"{prefix}_ms_all": pooled,
            f"{prefix}_ms_repeat_medians": medians,
            f"{prefix}_ms_repeat_min": min(medians), f"{prefix}_ms_repeat_max": max(medians),
            f"{prefix}_ms_repeat_spread": (max(medians) - min(medians)) / middle if middle > 0 else 0.0,
        })
    row.pop("round", None)
    row.pop("position", None)
    row["repeats"] = len(repeats)
    row["repeat_results"] = list(repeats)
    return row

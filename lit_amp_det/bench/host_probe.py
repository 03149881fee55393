"""A memory-copy probe of the host's phase, read before and after each bench repeat's timed steps.

A process on the dev VM (2 vCPUs on an AMD EPYC Zen 4 host) alternates every 5-30 s between two phases that a 64 MB
copy tells apart: about 35 GB/s in one, 52 in the other, where the R50-FPN's bf16 training step (row 14) took 1.11x
as long, its RoIAlign backward 2x and fp32 Winograd layers 1.7x, while oneDNN's direct convolutions did not move
(BENCHMARKS.md, "Two host phases"; ``examples/host_phases.py``). A repeat that ran in the other phase moves one of a
row's repeat medians; the readings beside it say which, so a reader can tell host from code.

The buffers (2 x 64 MB) are made and touched once per process, before the row's model is built: the row's peak
memory above the built model, its kept heap and its memory over changing batches do not count them (its absolute
peak, ``peak_memory_abs_mb``, does), and the copies make no page faults. On CUDA it reads nothing (the host's phase
does not time GPU kernels). JSON: each repeat's ``[before, after]`` as ``host_copy_gbps`` in ``repeat_results`` (the
row's own ``host_copy_gbps`` is its first repeat's, as for every non-numeric field).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from lit_amp_det.bench.e2e_report import each_repeat_text

__all__ = ["PROBE_MB", "CopyProbe", "probe_text"]

#: Size of the copied buffer: far beyond the 2 vCPUs' share of the caches, as in ``examples/host_phases.py``.
PROBE_MB = 64


class CopyProbe:
    """Copies a ``megabytes`` fp32 buffer into another: :meth:`gbps` is the best of ``tries`` copies, in GB/s read
    and written. None on a device other than the CPU."""

    def __init__(self, device: str, megabytes: int = PROBE_MB) -> None:
        self._source = self._target = None
        if device == "cpu":
            self._source = torch.ones(megabytes * 2**18)  # 4 bytes an element; ones: the pages are touched now
            self._target = torch.zeros_like(self._source)

    def gbps(self, tries: int = 3) -> float | None:
        if self._source is None:
            return None
        best = float("inf")
        for _ in range(tries):
            start = time.perf_counter()
            self._target.copy_(self._source)
            best = min(best, time.perf_counter() - start)
        return 2 * self._source.numel() * self._source.element_size() / best / 1e9


def probe_text(row: Mapping[str, Any]) -> str:
    """Each repeat's copy probe before its warm-up and after its timed steps, GB/s, in run order (``35-34 / 52-51``:
    the second repeat ran in the other phase); ``-`` where a repeat has none (CUDA, or a result without the probe)."""
    def readings_text(repeat: Mapping[str, Any]) -> str:
        readings = repeat.get("host_copy_gbps")
        if not readings or any(r is None for r in readings):
            return "-"
        return "-".join(f"{r:.0f}" for r in readings)

    return each_repeat_text(row, readings_text)

"""Benchmarks (``python -m lit_amp_det bench <name>``): measured side by side, never part of the test suite."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main", "BENCHMARKS"]

#: benchmark name -> module with a ``main(argv)``
BENCHMARKS = {"precision": "lit_amp_det.bench.precision", "ops": "lit_amp_det.bench.ops",
              "convbn": "lit_amp_det.bench.convbn", "train": "lit_amp_det.bench.train",
              "infer": "lit_amp_det.bench.infer", "coco_eval": "lit_amp_det.bench.coco_eval",
              "weights_ab": "lit_amp_det.bench.weights_ab"}


def main(argv: Sequence[str]) -> None:
    """Runs ``bench <name> [options]``."""
    if not argv or argv[0] not in BENCHMARKS:
        sys.exit(f"lit_amp_det bench: choose one of {', '.join(BENCHMARKS)} (e.g. `python -m lit_amp_det bench "
                 "precision --help`)")
    import importlib

    importlib.import_module(BENCHMARKS[argv[0]]).main(list(argv[1:]))

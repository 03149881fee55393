"""Benchmarks (``python -m lit_amp_det bench <name>``): measured side by side, never part of the test
suite.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

__all__ = ["main", "BENCHMARKS"]

#: benchmark name -> ``module:function`` taking the rest of the command line
BENCHMARKS = {
    "train": "lit_amp_det.bench.e2e:train",
    "infer": "lit_amp_det.bench.e2e:infer",
    "precision": "lit_amp_det.bench.e2e:precision",
    "ops": "lit_amp_det.bench.ops:main",
    "convbn": "lit_amp_det.bench.convbn:main",
    "coco_eval": "lit_amp_det.bench.coco_eval:main",
}


def main(argv: Sequence[str]) -> None:
    """Runs ``bench <name> [options]``."""
    usage = f"usage: python -m lit_amp_det bench {{{','.join(BENCHMARKS)}}} [--help]"
    if argv and argv[0] in ("-h", "--help"):
        print(f"{usage}\n\n{__doc__}")
        return
    if not argv or argv[0] not in BENCHMARKS:
        sys.exit(
            f"lit_amp_det bench: choose one of {', '.join(BENCHMARKS)} (e.g. `python -m lit_amp_det bench "
            "train --help`)"
        )
    module, function = BENCHMARKS[argv[0]].split(":")
    getattr(importlib.import_module(module), function)(list(argv[1:]))

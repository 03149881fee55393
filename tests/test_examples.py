"""The A/B scripts in ``examples/`` run: each change they swap in and out still fits the code it replaces.

They are measuring tools, so nothing here times anything: each runs on the tiny model for one or two pairs, in its
own process (the scripts patch module globals), on a shared cache that holds the tiny model's trained bench state and
the peaks. At 128 px, batch 2, the tiny model's backbone layer1 (64 channels, 512 2x2 tiles) passes the fp32
Winograd size rule, so the Winograd changes run their patched paths. ``mask_paste_ab.py`` runs on the same tiny
state (its default, the light model's, takes minutes to make); ``weighted_loss.py`` trains in ``tests/test_cli.py``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lit_amp_det.precision.hardware import cpu_computes_bf16_natively

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "maskrcnn_tiny", "--size", "128", "--batch", "2"]
#: the last line every paired script prints: both arms' medians and the paired figures
SUMMARY = re.compile(r"A [\d.]+ ms, B [\d.]+ ms, [\d.]+x; paired A - B median .* B faster in \d+/(\d+) pairs")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One bench cache for the module: the tiny state and the peaks are made by the first script only."""
    return tmp_path_factory.mktemp("example_cache")


def launch(script: str, args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "LIT_AMP_DET_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def run_example(script: str, args: list[str], cache: Path) -> str:
    proc = launch(script, args, cache)
    assert proc.returncode == 0, f"{script} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


@pytest.mark.parametrize("args", [
    ["--change", "all", "--row", "winograd-4x4"],  # the weight transforms, the size rule and the fp32 upsampling
    ["--change", "memory-order-views", "--row", "winograd-4x4"],
    ["--change", "memory-order-views", "--row", "winograd-4x4", "--optimizer-only"],
    ["--change", "linear-gradient-layout", "--row", "pointwise-matmul", "--precision", "bf16"],
    ["--change", "split-vector-rule", "--row", "winograd", "--precision", "bf16"],
    ["--against", "torchvision-fp32", "--row", "winograd-4x4"],
], ids=["all", "memory-order-views", "optimizer-only", "linear-gradient-layout", "split-vector-rule", "against"])
def test_paired_step_ab_runs_each_change(args: list[str], cache: Path) -> None:
    if "bf16" in args and not cpu_computes_bf16_natively():
        pytest.skip("the bf16 row takes torch's slow paths on a CPU without native bf16")
    out = run_example("paired_step_ab.py", [*args, *TINY, "--pairs", "2"], cache)
    match = SUMMARY.search(out.strip().splitlines()[-1])
    assert match is not None and match.group(1) == "2", out[-2000:]


def test_paired_step_ab_names_an_unknown_row(cache: Path) -> None:
    proc = launch("paired_step_ab.py", ["--row", "no-such-row"], cache)
    assert proc.returncode == 2 and "no bench train row 'no-such-row'" in proc.stderr


def test_paired_infer_ab_runs_the_weight_tile_cache(cache: Path) -> None:
    out = run_example("paired_infer_ab.py", ["--row", "winograd-4x4", *TINY, "--pairs", "2"], cache)
    assert out.count("B faster in") == 2, out[-2000:]  # throughput at --batch, then latency at batch 1


def test_mask_paste_ab_compares_both_pastes_in_time_and_memory(cache: Path) -> None:
    out = run_example("mask_paste_ab.py", ["--model", "maskrcnn_tiny", "--model-size", "128", "--state-batch", "2",
                                           "--size", "160", "--batch", "2", "--pairs", "2", "--photo", "320", "240",
                                           "--memory-repeats", "1"], cache)
    timing = re.search(r"time: 160x160 pictures, batch 2, detections per picture \[(\d+), (\d+)\] \(the same masks "
                       r"in both arms\).* B faster in \d+/2 pairs", out)
    assert timing is not None, out[-2000:]
    assert min(map(int, timing.groups())) > 0, out[-2000:]  # the pastes had masks to compare
    assert re.search(r"memory: one 320x240 picture, [1-9]\d* detections \(the same masks in both arms\), 1 fresh "
                     r"processes per arm", out), out[-2000:]


def test_host_phases_probes_and_summarises(cache: Path) -> None:
    out = run_example("host_phases.py", ["--seconds", "0", "--layer", "2x16x8x8", "--copy-mb", "4"], cache)
    lines = out.strip().splitlines()
    assert re.search(r"copy +[\d.]+ GB/s \| Winograd +[\d.]+ ms, direct +[\d.]+ ms, [\d.]+x", lines[-3]), out
    assert lines[-2] == "one phase: no two groups of copy bandwidth 1.2x apart", out  # one probe: nothing to split
    assert re.fullmatch(r"all probes: 1 probes, copy [\d.]+ GB/s, Winograd [\d.]+ ms, direct [\d.]+ ms, [\d.]+x",
                        lines[-1]), out
    assert launch("host_phases.py", ["--layer", "2x16x8"], cache).returncode == 2


def test_host_phases_splits_probes_at_the_widest_gap_in_copy_bandwidth() -> None:
    spec = importlib.util.spec_from_file_location("host_phases", ROOT / "examples" / "host_phases.py")
    host_phases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_phases)
    split = host_phases.split_at_widest_gap
    # the dev VM's two phases: about 33 and 47 GB/s
    assert split([32.5, 47.7, 33.2, 31.6, 48.5, 45.1], 1.2) == pytest.approx((33.2 + 45.1) / 2)
    assert split([32.5, 33.2, 31.6, 34.0, 30.9], 1.2) is None  # one phase: the widest gap splits noise
    assert split([32.5, 47.7, 33.2], 1.2) is None  # too few probes for two groups of two
    assert split([20.0, 21.0, 23.0, 24.0], 1.1) == pytest.approx(22.0)

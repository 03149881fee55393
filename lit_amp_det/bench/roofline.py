"""The roofline column: how much of the device's measured peak a row's step reaches.

Two measurements, both outside the timed steps:

* **FLOPs per step**, counted once per row with :class:`torch.utils.flop_counter.FlopCounterMode` on one extra
  call after the timed ones (a training step: forward and backward; inference: the forward). It counts the
  matrix products and convolutions (not elementwise ops, norms, RoIAlign or NMS), which is where the work is.
  A compiled row is counted with ``torch.compiler.set_stance("force_eager")``: the same maths, counted eagerly.
* **Peak GFLOP/s** of the device per compute dtype, measured by the bench itself: the faster of two probes, a
  square matmul sized to take about ``target_s`` seconds, and as many 3x3 convolutions of an FPN level's shape
  (256 channels in and out, 64x64, channels_last, batch 2) as take that long, best of a few runs each. The
  convolution is there because a matmul alone can miss the peak: on AMD CPUs MKL's sgemm runs its AVX2 code (about
  200 GFLOP/s fp32 on the 2-core EPYC) while oneDNN's convolutions use AVX-512 (about 480), so against the matmul
  alone a fp32 step's convolutions read 170 % of "the peak". Each dtype's entry keeps both probes
  (``matmul_gflops``, ``conv_gflops``). Cached per machine in ``<cache>/bench_peaks.json``, keyed by
  the CPU model or GPU name, the torch version and the thread count, so later runs reuse it. On CUDA the fp32
  peak is measured with TF32 as cuDNN's convolutions use it (``torch.backends.cudnn.allow_tf32``). On a CPU the
  bench first looks at how many CPUs other work keeps busy (:func:`busy_cpus`, one second of ``/proc/stat``):
  above half a CPU the peak is measured and used for this run but not cached, since a loaded machine measures a
  low peak that would inflate every later ``peak_fraction``.

A row's ``achieved_gflops`` is its FLOPs over its median step time; ``peak_fraction`` divides that by the peak
of the dtype its maths runs in: fp32 rows against the fp32 peak, ``bf16-mixed``/``16-mixed`` rows against the
bf16/fp16 peak (under autocast most of the FLOPs, the convolutions and matmuls, run in the low precision).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from lit_amp_det.bench.common import cpu_name, replace_file
from lit_amp_det.precision.hardware import cpu_capability
from lit_amp_det.profiling import timed

__all__ = ["DTYPES", "IN_PLACE_PRODUCTS", "PEAKS_FILE", "busy_cpus", "compute_dtype", "count_flops", "device_peaks",
           "in_place_flop_formulas", "machine_key", "measure_peak", "roofline"]

#: Compute dtype name -> torch dtype.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: The peaks cache, in the benches' cache folder.
PEAKS_FILE = "bench_peaks.json"
#: CPUs busy with other work above which a CPU peak is not cached (measured, used for the run, then dropped).
MAX_BUSY_CPUS_TO_CACHE = 0.5


def _cpu_jiffies() -> tuple[int, int, int]:
    """``(all, idle + iowait, CPUs)`` from ``/proc/stat``: time spent by all CPUs since boot, in clock ticks."""
    with open("/proc/stat") as stat:
        lines = stat.read().splitlines()
    values = [int(v) for v in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return sum(values), values[3] + values[4], cpus


def busy_cpus(seconds: float = 1.0) -> float | None:
    """How many CPUs other work keeps busy: the non-idle share of all CPUs over ``seconds`` while this process
    sleeps, times the CPU count. ``None`` where ``/proc/stat`` cannot be read (not Linux)."""
    try:
        total0, idle0, cpus = _cpu_jiffies()
        time.sleep(seconds)
        total1, idle1, _ = _cpu_jiffies()
    except (OSError, ValueError, IndexError):
        return None
    elapsed = total1 - total0
    if elapsed <= 0:
        return None
    return (elapsed - (idle1 - idle0)) / elapsed * cpus


def compute_dtype(precision: str) -> str:
    """The dtype a Lightning precision string's maths runs in: ``fp32``, ``bf16`` or ``fp16``."""
    text = str(precision)
    if text.startswith("bf16"):
        return "bf16"
    if text.startswith("16"):
        return "fp16"
    if text.startswith("32"):
        return "fp32"
    raise ValueError(f"precision {precision!r}: expected a Lightning precision such as 32-true, bf16-mixed or "
                     "16-mixed")


#: In-place matrix products and the out-of-place op whose FLOP formula they share. FlopCounterMode has formulas
#: for ``addmm``/``baddbmm`` only, so ``total.baddbmm_(a, b)`` (the Winograd weight gradient's sum over chunks)
#: would count as 0 FLOPs and its row's GFLOP/step and peak fraction would read low.
IN_PLACE_PRODUCTS = {"addmm_": "addmm", "baddbmm_": "baddbmm"}


def _raw(formula: Callable[..., int]) -> Callable[..., int]:
    """``formula`` (already shape-wrapped in torch's registry) marked so that FlopCounterMode does not wrap it again."""

    def counted(*args: Any, **kwargs: Any) -> int:
        return formula(*args, **kwargs)

    counted._get_raw = True  # type: ignore[attr-defined]
    return counted


def in_place_flop_formulas() -> dict[Any, Callable[..., int]]:
    """FlopCounterMode ``custom_mapping`` entries giving each of :data:`IN_PLACE_PRODUCTS` its out-of-place op's
    formula (the same FLOPs: ``self`` is both the added input and the output)."""
    from torch.utils.flop_counter import flop_registry

    formulas = {}
    for in_place, out_of_place in IN_PLACE_PRODUCTS.items():
        formula = flop_registry.get(getattr(torch.ops.aten, out_of_place))
        if formula is not None:
            formulas[getattr(torch.ops.aten, in_place)] = _raw(formula)
    return formulas


def count_flops(fn: Callable[[], Any]) -> int:
    """FLOPs of one call of ``fn`` as :class:`~torch.utils.flop_counter.FlopCounterMode` counts them, with the
    in-place matrix products (:data:`IN_PLACE_PRODUCTS`) counted like their out-of-place ops.

    Compiled modules run eagerly for the count (``force_eager``), so every operation passes the counter.
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=in_place_flop_formulas())
    with torch.compiler.set_stance("force_eager"), counter:
        fn()
    return int(counter.get_total_flops())


def machine_key(device: str) -> str:
    """What a peak depends on: the CPU (its model name, family and model numbers and Zen generation, with torch's CPU
    capability: one model name, "AMD EPYC" say, covers CPUs with and without AVX-512, and Zen 4 and Zen 5 hosts whose
    peaks differ 2x) or GPU name, the torch version and the torch thread count."""
    name = torch.cuda.get_device_name() if device == "cuda" else f"{cpu_name()} {cpu_capability()}"
    return f"{device}|{name}|torch {torch.__version__}|{torch.get_num_threads()} threads"


@contextlib.contextmanager
def _fp32_like_convolutions(device: str):
    """On CUDA, matmuls in TF32 exactly when cuDNN's fp32 convolutions are (restored afterwards)."""
    if device != "cuda":
        yield False
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32
    try:
        yield torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _matmul_seconds(n: int, dtype: torch.dtype, device: str, runs: int) -> list[float]:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return [timed(lambda: torch.mm(a, b), device) for _ in range(runs)]


#: The convolution probe: a 3x3 convolution of 256 channels on a 2 x 256 x 64 x 64 channels_last input, the shape
#: of an FPN level's convolutions (larger inputs run slower per FLOP on a CPU: they no longer fit in cache).
_CONV_BATCH, _CONV_CHANNELS, _CONV_KERNEL, _CONV_SIDE = 2, 256, 3, 64
_CONV_FLOPS = 2 * _CONV_BATCH * _CONV_CHANNELS * _CONV_CHANNELS * _CONV_KERNEL**2 * _CONV_SIDE**2


def _conv_seconds(calls: int, dtype: torch.dtype, device: str, runs: int) -> list[float]:
    """Seconds of ``calls`` back-to-back probe convolutions, ``runs`` times."""
    x = torch.randn(_CONV_BATCH, _CONV_CHANNELS, _CONV_SIDE, _CONV_SIDE, device=device).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    w = torch.randn(_CONV_CHANNELS, _CONV_CHANNELS, _CONV_KERNEL, _CONV_KERNEL, device=device).to(dtype)
    w = w.contiguous(memory_format=torch.channels_last)

    def convolutions() -> None:
        for _ in range(calls):
            torch.nn.functional.conv2d(x, w, padding=_CONV_KERNEL // 2)

    return [timed(convolutions, device) for _ in range(runs)]


def _best_of(probe: Callable[[int, int], list[float]], size: int, flops: Callable[[int], int], exponent: int,
             target_s: float, runs: int, step: int, largest: int) -> tuple[float, int, float]:
    """``(GFLOP/s, size, best seconds)`` of ``probe(size, calls)`` at the size (a multiple of ``step``) that takes
    about ``target_s``, FLOPs growing as ``size ** exponent``.

    One untimed and one timed call at the starting ``size`` set the size; one untimed call at it, then ``runs``
    timed ones.
    """
    seconds = min(probe(size, 2)[1:])
    scale = (target_s / max(seconds, 1e-9)) ** (1 / exponent)
    chosen = int(min(largest, max(step, round(size * scale / step) * step)))
    best = min(probe(chosen, runs + 1)[1:])
    return flops(chosen) / best / 1e9, chosen, best


def measure_peak(device: str, dtype: str, target_s: float = 0.5, runs: int = 3) -> dict[str, Any]:
    """The device's peak GFLOP/s in ``dtype``: the faster of two probes, each the best of ``runs`` calls sized to
    take about ``target_s``: an ``n x n`` matmul (``n`` a multiple of 256, 256 to 16384, set by a 1024 matmul)
    and ``calls`` back-to-back 3x3 convolutions of 256 channels on a ``2 x 256 x 64 x 64`` channels_last input
    (``calls`` set by one convolution).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    with _fp32_like_convolutions(device) as tf32:
        matmul, n, best = _best_of(lambda size, k: _matmul_seconds(size, torch_dtype, device, k), 1024,
                                   lambda size: 2 * size**3, 3, target_s, runs, 256, 16384)
        conv, calls, conv_best = _best_of(lambda count, k: _conv_seconds(count, torch_dtype, device, k), 1,
                                          lambda count: count * _CONV_FLOPS, 1, target_s, runs, 1, 10_000)
    return {"gflops": max(matmul, conv), "probe": "conv3x3" if conv > matmul else "matmul",
            "matmul_gflops": matmul, "n": n, "best_s": best, "conv_gflops": conv, "conv_calls": calls,
            "conv_best_s": conv_best, "runs": runs, "target_s": target_s, "tf32": tf32,
            "measured_at": datetime.datetime.now().isoformat(timespec="seconds")}


def device_peaks(device: str, dtypes: Iterable[str], cache: Path, target_s: float = 0.5) -> dict[str, Any]:
    """Peaks of ``dtypes`` on this machine: from ``cache/bench_peaks.json``, measuring (and adding) what is missing.

    Returns ``{"key", "file", "peaks": {dtype: {...}}, "measured": [dtypes measured now], "cached": [...],
    "busy_cpus"}``: ``busy_cpus`` is what other work kept busy before measuring on a CPU (``None`` when nothing was
    measured, on CUDA, or off Linux). Above :data:`MAX_BUSY_CPUS_TO_CACHE` the new peaks are returned (each with
    ``"busy_cpus"``) but not written, with a warning on stderr.
    """
    path = cache / PEAKS_FILE
    key = machine_key(device)
    table: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    entry = table.get(key, {})
    wanted = list(dict.fromkeys(dtypes))
    missing = [d for d in wanted if "conv_gflops" not in entry.get(d, {})]  # older entries had no conv probe
    busy = busy_cpus() if missing and device == "cpu" else None
    loaded = busy is not None and busy > MAX_BUSY_CPUS_TO_CACHE
    for dtype in missing:
        entry[dtype] = {**measure_peak(device, dtype, target_s), **({"busy_cpus": busy} if loaded else {})}
    if loaded:
        print(f"\nwarning: other work kept {busy:.1f} CPUs busy before the peaks were measured; this run uses them, "
              f"but they are not cached in {path} (measure again on a quiet machine)", file=sys.stderr, flush=True)
    elif missing:
        table = json.loads(path.read_text()) if path.is_file() else {}  # another bench may have added its own
        table[key] = {**table.get(key, {}), **entry}
        replace_file(path, (json.dumps(table, indent=2) + "\n").encode())
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"key": key, "file": str(path), "peaks": {d: entry[d] for d in wanted}, "measured": missing,
            "cached": [d for d in wanted if d not in missing], "busy_cpus": busy}


def roofline(gflop_per_step: float | None, step_ms: float, dtype: str,
             peaks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``achieved_gflops`` (GFLOP per step over the step time) and ``peak_fraction`` (of ``dtype``'s peak).

    ``None`` for what cannot be computed (no count, no peak for the dtype).
    """
    achieved = gflop_per_step / (step_ms / 1000) if gflop_per_step is not None and step_ms > 0 else None
    peak = peaks.get(dtype, {}).get("gflops")
    return {"compute_dtype": dtype, "peak_gflops": peak, "achieved_gflops": achieved,
            "peak_fraction": achieved / peak if achieved is not None and peak else None}

"""Host time of one Triton launch of lit_amp_det's kernels, up to the driver call, measured on a machine
without a GPU.

What a GPU launch costs the host before the driver takes over: lit_amp_det's launcher
(``lit_amp_det.ops.triton._launch._launch``) and Triton's ``JITFunction.run`` (argument binding,
specialisation and cache key, launch metadata and hooks) on the compiled kernel, compiled ahead of time for
sm_90 as ``tools/triton_compile.py`` compiles it. Only what needs a GPU is stood in for: Triton's driver
answers device 0, stream 0 and an sm_90 target; the compiled kernel's C launcher (``CompiledKernel.run``,
which packs the arguments and calls ``cuLaunchKernelEx``, the same for every row) only counts;
``torch.cuda``'s current-device and exchange-device calls return 0; the tensors are CPU tensors that report
``cuda:0`` as their device (a subclass without ``__torch_dispatch__``, so the dispatcher treats them as plain
dense tensors). The arguments are those the real launchers pass for an IoU matrix (9 positional arguments, 5
keywords) and a RoIAlign forward (24 and 7), with a GPU's launch configurations.

Rows, timed in interleaved repeats (ratios, not lone times, are what carry over to another CPU):

* ``wrap_triton in torch.cuda.device``: the launch as lit_amp_det made it before issue 53, through
  ``torch.library.wrap_triton`` (the higher-order-op dispatcher in eager mode) inside a device context;
* ``_launch``: the launcher of this checkout;
* ``kernel[grid]``: Triton's own launcher alone, the floor.

The side-table column counts the entries one launch adds to ``kernel_side_table``'s constant arguments (kept
for the life of the process).

    python tools/triton_launch_overhead.py [--repeats 15] [--launches 500]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from lit_amp_det.ops.triton import _launch

__all__ = ["Launch", "before", "main", "measure", "recorded_launches", "stand_in_gpu"]

_CUDA0 = torch.device("cuda", 0)


@dataclass(frozen=True)
class Launch:
    """One launch as a launcher made it: the compiled kernel, its grid, positional arguments and keywords."""

    name: str
    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    meta: dict


class _OnCuda(torch.Tensor):
    """A CPU tensor that reports ``cuda:0``: a real data pointer and dtype for Triton's binder, the device a
    GPU launch reads. No ``__torch_dispatch__``, so the dispatcher sees a plain dense tensor.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self) -> torch.device:
        return _CUDA0


def _on_cuda(value: Any) -> Any:
    return torch.Tensor._make_subclass(_OnCuda, value) if isinstance(value, torch.Tensor) else value


class _StandInLauncher:
    """Stands for the compiled kernel's C launcher (it packs the arguments and calls ``cuLaunchKernelEx``):
    counts.
    """

    calls = 0

    def __init__(self, src: Any, metadata: Any) -> None:
        pass

    def __call__(self, *args: Any) -> None:
        _StandInLauncher.calls += 1


class _StandInUtils:
    """Loading a compiled binary onto device 0: handles that the stand-in launcher never dereferences."""

    MODULE = 1  # the handle of every module it loads

    def load_binary(
        self, name: str, kernel: bytes, shared: int, device: int
    ) -> tuple[int, int, int, int, int]:
        return self.MODULE, 1, 0, 0, 1024  # module, function, registers, spills, most threads a block

    def unload_module(self, module: int) -> None:
        pass

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": 232448}  # an H100's, per block


class _StandInDriver:
    """What Triton asks its driver for a launch, answered as for one H100/H200 (device 0, stream 0, sm_90)."""

    launcher_cls = _StandInLauncher
    utils = _StandInUtils()

    def get_current_device(self) -> int:
        return torch.cuda.current_device()  # as Triton's CUDA driver answers (stubbed in stand_in_gpu)

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def stand_in_gpu() -> Iterator[None]:
    """Within the block, Triton's driver and ``torch.cuda``'s device calls answer as for one GPU, device 0."""
    from triton.runtime import driver

    patched = {
        "current_device": lambda: 0,
        "_exchange_device": lambda device: 0,
        "_maybe_exchange_device": lambda device: 0,
    }
    saved = {name: getattr(torch.cuda, name) for name in patched}
    previous = driver._active  # None without a GPU: set_active/reset_active would look for a real driver
    for name, stub in patched.items():
        setattr(torch.cuda, name, stub)
    driver.set_active(_StandInDriver())
    try:
        yield
    finally:
        _forget_stand_in_modules()
        driver._active = previous
        for name, original in saved.items():
            setattr(torch.cuda, name, original)


def _forget_stand_in_modules() -> None:
    """Marks the kernels loaded by the stand-in as unloaded: Triton unloads a kernel's module when the kernel
    is collected, through whatever driver is active then, and after the block there is none to ask.
    """
    from triton.compiler.compiler import CompiledKernel

    for candidate in gc.get_objects():
        # by exact type: gc also holds weak proxies, which isinstance would dereference
        if type(candidate) is CompiledKernel and candidate.module == _StandInUtils.MODULE:
            candidate.module = None


def recorded_launches(kernels: ModuleType) -> list[Launch]:
    """The launches of an IoU matrix (300 x 20 boxes) and of a RoIAlign forward (512 RoIs, 256 channels, 7 x
    7) with a GPU's launch configurations, recorded while the real launchers run on CPU tensors (nothing is
    launched).
    """
    launches: list[Launch] = []

    def record(kernel, grid, *args, **meta) -> None:
        launches.append(Launch(kernel.fn.__name__, kernel, grid, args, meta))

    g = torch.Generator().manual_seed(0)
    boxes = torch.rand(300, 4, generator=g) * 100
    boxes[:, 2:] += boxes[:, :2]
    features = torch.randn(2, 256, 50, 84, generator=g)
    rois = torch.cat([torch.zeros(512, 1), boxes[:1].expand(512, 4)], 1)
    original_launch, original_kernels = _launch._launch, _launch._kernels
    _launch._launch, _launch._kernels = record, lambda device: kernels
    try:
        with _launch.gpu_launch_configs():
            _launch.box_iou(boxes, boxes[:20])
            _launch.roi_align(features, rois, 0.25, 7, 7, 2, True)
    finally:
        _launch._launch, _launch._kernels = original_launch, original_kernels
    return [Launch(x.name, x.kernel, x.grid, tuple(map(_on_cuda, x.args)), x.meta) for x in launches]


def before(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """The launch as ``_launch`` made it before issue 53: ``wrap_triton`` inside a ``torch.cuda.device``
    context.
    """
    with torch.cuda.device(args[0].device if isinstance(args[0], torch.Tensor) else None):
        torch.library.wrap_triton(kernel)[grid](*args, enable_fp_fusion=False, **meta)


def _floor(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    kernel[grid](*args, enable_fp_fusion=False, **meta)


def _this_checkout(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    _launch._launch(kernel, grid, *args, **meta)  # looked up per call: the module's current launcher


#: the rows, first the reference the ratios are taken to
PATHS: dict[str, Callable[..., None]] = {
    "wrap_triton in torch.cuda.device (before)": before,
    "_launch (this checkout)": _this_checkout,
    "kernel[grid] (Triton alone)": _floor,
}


def _side_table_size() -> int:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    return len(kernel_side_table.constant_args)


def _time(path: Callable[..., None], launch: Launch, launches: int) -> float:
    """Microseconds per launch over ``launches`` launches."""
    start = time.perf_counter()
    for _ in range(launches):
        path(launch.kernel, launch.grid, *launch.args, **launch.meta)
    return (time.perf_counter() - start) / launches * 1e6


def measure(repeats: int, launches: int) -> list[dict[str, Any]]:
    """Per kernel and path: median microseconds per launch over ``repeats`` interleaved repeats, the ratio to
    the first path, and the side-table entries one launch adds.

    Raises:
        RuntimeError: if a path did not reach the (stubbed) driver call once per launch.
    """
    kernels = _launch.load_kernels(interpret=False)
    rows = []
    with stand_in_gpu():
        recorded = recorded_launches(kernels)
        for launch in recorded:
            for path in PATHS.values():  # warm up: compiles for sm_90, imports, first-call caches
                _time(path, launch, 3)
            times: dict[str, list[float]] = {name: [] for name in PATHS}
            for repeat in range(repeats):
                names = list(PATHS)
                names = (
                    names[repeat % len(names) :] + names[: repeat % len(names)]
                )  # each path in each position
                for name in names:
                    times[name].append(_time(PATHS[name], launch, launches))
            reference = statistics.median(times[next(iter(PATHS))])
            for name, path in PATHS.items():
                table, reached = _side_table_size(), _StandInLauncher.calls
                _time(path, launch, launches)
                if _StandInLauncher.calls - reached != launches:
                    raise RuntimeError(
                        f"{name}: {_StandInLauncher.calls - reached} driver calls for {launches} "
                        "launches; every launch must reach the (stand-in) driver call once"
                    )
                median = statistics.median(times[name])
                rows.append(
                    {
                        "kernel": launch.name,
                        "path": name,
                        "us": median,
                        "ratio": median / reference,
                        "side_table": (_side_table_size() - table) / launches,
                    }
                )
    return rows


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or "unknown CPU"


def report(rows: Sequence[dict[str, Any]], repeats: int, launches: int) -> str:
    """The markdown table of :func:`measure`'s rows, headed by the machine and versions."""
    import triton

    lines = [
        f"{_cpu_model()}, torch {torch.__version__}, triton {triton.__version__}; median of {repeats} "
        f"interleaved repeats of {launches} launches, up to the (stubbed) driver call",
        "",
        "| kernel | path | us per launch | ratio to before | side-table entries per launch |",
        "|---|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['kernel']} | {row['path']} | {row['us']:.1f} | {row['ratio']:.3f} | "
            f"{row['side_table']:g} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python tools/triton_launch_overhead.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=15, help="interleaved repeats per path (default 15)")
    parser.add_argument("--launches", type=int, default=500, help="launches timed per repeat (default 500)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.launches < 1:
        parser.error(f"--repeats and --launches must be >= 1, got {args.repeats} and {args.launches}")
    print(report(measure(args.repeats, args.launches), args.repeats, args.launches))


if __name__ == "__main__":
    main(sys.argv[1:])

"""``make gpu-compile``: every Triton launch the model makes, compiled ahead of time for GPUs: registers and
spills.

No GPU is needed. The real launchers of :mod:`lit_amp_det.ops.triton` run on fake CUDA tensors (PyTorch's
``FakeTensorMode``: shapes, strides and dtypes, no memory), with the launch itself replaced by a recorder;
each recorded launch is then specialised as Triton's launcher specialises it (its own binder: integers equal
to 1 and divisibility by 16 of integers and of pointers, which the CUDA caching allocator aligns), compiled
for each target, and Triton's bundled ``ptxas -v`` reports the registers and spill bytes per thread (on AMD,
the code object's own ``vgpr`` and spill counts). Running the launchers under ``FakeTensorMode`` also shows
that none of them reads a tensor's value on the host: a launcher that synchronised would fail here.

The launches are those of the model's sizes: RoIAlign for the box head (7x7), the mask head (14x14) and mask
targets (28x28, one channel) at 32, 64 and 256 channels over R50-FPN levels of an 800x1333 image; NMS of the
RPN (2,000 boxes per level, 10,000 in all), of the detector (per class) and alone; the IoU of the matchers.
fp64 kernels are compiled too and may spill (no model runs them on a GPU); the report marks them, the check
ignores them.

``python tools/triton_compile.py [--targets sm_80,sm_90,sm_100,gfx942] [--out DIR]`` (``make gpu-compile``)
writes ``triton_compile.md``/``.json``; it exits with status 1 if an fp16/bf16/fp32 specialisation spills. A
developer's tool for the kernels, so it lives beside the package, not in it; ``tests/test_triton_compile.py``
runs it on a subset.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from lit_amp_det.ops.triton import _launch

__all__ = [
    "Launch",
    "Usage",
    "compile_launch",
    "compiled_kernels",
    "model_launches",
    "main",
    "recorded_launches",
    "TARGETS",
]

#: compile targets by name: (backend, architecture, warp size)
TARGETS = {
    "sm_80": ("cuda", 80, 32),
    "sm_90": ("cuda", 90, 32),
    "sm_100": ("cuda", 100, 32),
    "gfx942": ("hip", "gfx942", 64),
}
#: the dtypes a model trains or infers in; fp64 specialisations are reported, never required to fit
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel's name, its positional arguments and its launch keywords."""

    kernel: str
    args: tuple
    meta: dict

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the launch's first floating-point tensor (what it computes on), else of its first
        tensor.
        """
        tensors = [a for a in self.args if isinstance(a, torch.Tensor)]
        return next((t.dtype for t in tensors if t.dtype.is_floating_point), tensors[0].dtype)


@dataclass(frozen=True)
class Usage:
    """What one specialisation of a kernel costs on one target."""

    target: str
    kernel: str
    dtype: str
    block: str
    num_warps: int
    registers: int
    spill_bytes: int
    shared_bytes: int

    @property
    def required(self) -> bool:
        """Whether the model's dtypes need this specialisation to fit (fp64 may spill)."""
        return self.dtype != "float64"


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """Within the block, the launchers record their launches instead of running them."""
    launches: list[Launch] = []
    original = _launch._launch

    def record(kernel, grid, *args, **meta) -> None:
        launches.append(Launch(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__, args, meta))

    _launch._launch = record
    try:
        yield launches
    finally:
        _launch._launch = original


def compiled_kernels() -> ModuleType:
    """The kernels module decorated for compilation, whatever ``TRITON_INTERPRET`` said when it was first
    imported.
    """
    return _launch.load_kernels(interpret=False)


def _fpn_levels(channels: int, dtype: torch.dtype, layout: torch.memory_format) -> list[torch.Tensor]:
    """R50-FPN's four pooled levels of two 800x1333 images (padded to 800x1344), strides 4 to 32."""
    return [
        torch.empty(2, channels, 800 // s, 1344 // s, device="cuda", dtype=dtype).contiguous(
            memory_format=layout
        )
        for s in (4, 8, 16, 32)
    ]


def _rois(count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    rois = torch.empty(count, 5, device="cuda", dtype=dtype)
    return rois, torch.empty(count, device="cuda", dtype=torch.int64)


def model_launches(
    dtypes: Sequence[torch.dtype] = (*MODEL_DTYPES, torch.float64),
    pools: Sequence[int] = (7, 14, 28),
    channels: Sequence[int] = (32, 64, 256),
    layouts: Sequence[torch.memory_format] = (torch.contiguous_format, torch.channels_last),
    deterministic: bool = True,
) -> list[Launch]:
    """The launches of the model's op calls at its sizes, recorded on fake CUDA tensors (nothing runs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with recorded_launches() as launches, FakeTensorMode():
        for dtype in dtypes:
            boxes = torch.empty(10000, 4, device="cuda", dtype=dtype)
            scores = torch.empty(10000, device="cuda", dtype=dtype)
            classes = torch.empty(10000, device="cuda", dtype=torch.int64)
            # the RPN in training: 2,000 boxes per level apart, 2,000 kept
            _launch.batched_nms_padded(boxes, scores, classes, 0.7, 2000, max_class_size=2000)
            _launch.batched_nms_padded(boxes[:1000], scores[:1000], classes[:1000], 0.5, 100)  # the detector
            _launch.nms_padded(boxes[:300], scores[:300], 0.5, 100)
            _launch.box_iou(boxes[:2000], boxes[:20])  # proposals against ground truth
            for pool in pools:
                for c in channels if pool < 28 else (1,):  # mask targets: one channel of masks
                    for layout in layouts:
                        levels = _fpn_levels(c, dtype, layout)
                        rois, level_of = _rois(512, dtype)
                        out = _launch.multi_level_roi_align(
                            levels, rois, level_of, [1 / 4, 1 / 8, 1 / 16, 1 / 32], pool, pool, 2, False
                        )
                        grad = torch.empty_like(out)
                        _launch.multi_level_roi_align_backward(
                            grad, levels, rois, level_of, [1 / 4, 1 / 8, 1 / 16, 1 / 32], pool, pool, 2, False
                        )
                        if deterministic:
                            with _deterministic():
                                _launch.roi_align_backward(
                                    grad[:64],
                                    rois[:64],
                                    0.25,
                                    pool,
                                    pool,
                                    2,
                                    c,
                                    *levels[0].shape[2:],
                                    2,
                                    False,
                                )
    return launches


@contextlib.contextmanager
def _deterministic() -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


def _stand_in(value: Any) -> Any:
    """A recorded argument as Triton's binder sees it: a fake tensor becomes a 16-byte-aligned pointer of its
    dtype.
    """
    from triton.runtime.jit import MockTensor

    return MockTensor(value.dtype) if isinstance(value, torch.Tensor) else value


def _bind(kernel: Any, launch: Launch, backend: Any) -> tuple[dict, Any, Any, Any]:
    """Triton's own binder on the recorded arguments: (launch keywords, bound arguments, specialisation,
    options).
    """
    from triton.runtime.jit import create_function_from_signature

    meta = {**launch.meta, "enable_fp_fusion": False}  # as _launch passes it
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    return meta, *binder(*map(_stand_in, launch.args), **meta)


def compile_launch(kernels: ModuleType, launch: Launch, target: str) -> Any:
    """Specialises ``launch`` as Triton's launcher would and compiles it for ``target``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    kernel = getattr(kernels, launch.kernel)
    gpu = GPUTarget(*TARGETS[target])
    backend = make_backend(gpu)
    meta, bound, specialization, options = _bind(kernel, launch, backend)
    options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound, specialization, options)
    return triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=gpu, options=options.__dict__
    )


def _ptxas_usage(ptx: str, target: str) -> tuple[int, int]:
    """(registers, spill-store bytes) per thread from Triton's own ``ptxas -v``."""
    import triton

    arch = TARGETS[target][1]
    ptxas = (
        triton.knobs.nvidia.ptxas_blackwell if arch >= 100 else triton.knobs.nvidia.ptxas
    )  # as Triton picks
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        log = subprocess.run(
            [
                ptxas.path,
                "-v",
                f"--gpu-name=sm_{arch}{'a' if arch >= 90 else ''}",
                str(source),
                "-o",
                str(Path(folder) / "kernel.cubin"),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    return registers, sum(int(b) for b in re.findall(r"(\d+) bytes spill stores", log))


def _amdgcn_usage(asm: str) -> tuple[int, int]:
    """(vector registers, spilled registers x 4 bytes) per lane from the code object's metadata."""
    registers = int(re.search(r"\.vgpr_count:\s+(\d+)", asm).group(1))
    spilled = sum(int(n) for n in re.findall(r"\.[sv]gpr_spill_count:\s+(\d+)", asm))
    return registers, 4 * spilled


def usage(kernels: ModuleType, launch: Launch, target: str) -> Usage:
    """Compiles one launch for one target and reads what it costs."""
    compiled = compile_launch(kernels, launch, target)
    if TARGETS[target][0] == "cuda":
        registers, spilled = _ptxas_usage(compiled.asm["ptx"], target)
    else:
        registers, spilled = _amdgcn_usage(compiled.asm["amdgcn"])
    block = " ".join(f"{k}={v}" for k, v in sorted(launch.meta.items()) if k.startswith(("BLOCK", "WORDS")))
    return Usage(
        target,
        launch.kernel,
        str(launch.dtype).removeprefix("torch."),
        block,
        int(launch.meta.get("num_warps", 4)),
        registers,
        spilled,
        int(compiled.metadata.shared),
    )


def specialisations(kernels: ModuleType, launches: Sequence[Launch], target: str) -> list[Launch]:
    """One launch per distinct specialisation (Triton compiles each once)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget(*TARGETS[target]))
    seen, distinct = set(), []
    for launch in launches:
        _, _, specialization, _ = _bind(getattr(kernels, launch.kernel), launch, backend)
        key = (launch.kernel, repr(specialization), repr(sorted(launch.meta.items())))
        if key not in seen:
            seen.add(key)
            distinct.append(launch)
    return distinct


def available_targets(names: Sequence[str]) -> list[str]:
    """The requested targets whose Triton backend is installed (the AMD one may be absent)."""
    import triton.backends

    return [
        name
        for name in names
        if ("nvidia" if TARGETS[name][0] == "cuda" else "amd") in triton.backends.backends
    ]


def report(rows: Sequence[Usage]) -> str:
    """The Markdown table: the worst specialisation per (target, kernel, dtype, block), spills first."""
    worst: dict[tuple, Usage] = {}
    for row in rows:
        key = (row.target, row.kernel, row.dtype, row.block, row.num_warps)
        if key not in worst or (row.spill_bytes, row.registers) > (
            worst[key].spill_bytes,
            worst[key].registers,
        ):
            worst[key] = row
    lines = [
        "| target | kernel | dtype | block | warps | registers | spill bytes | shared bytes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in sorted(worst.values(), key=lambda r: (r.target, r.kernel, r.dtype, r.block)):
        mark = " (fp64: may spill)" if not row.required and row.spill_bytes else ""
        lines.append(
            f"| {row.target} | {row.kernel} | {row.dtype} | {row.block} | {row.num_warps} | {row.registers} "
            f"| {row.spill_bytes}{mark} | {row.shared_bytes} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python tools/triton_compile.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated: " + ", ".join(TARGETS))
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_compile"), help="folder of the report")
    args = parser.parse_args(list(argv))
    unknown = [t for t in args.targets.split(",") if t not in TARGETS]
    if unknown:
        parser.error(f"--targets: unknown {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    targets = available_targets(args.targets.split(","))
    kernels, launches = compiled_kernels(), model_launches()
    rows = []
    for target in targets:
        for launch in specialisations(kernels, launches, target):
            rows.append(usage(kernels, launch, target))
            print(
                f"{rows[-1].target} {rows[-1].kernel} {rows[-1].dtype} {rows[-1].block}: "
                f"{rows[-1].registers} registers, {rows[-1].spill_bytes} bytes spilled",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    table = report(rows)
    (args.out / "triton_compile.md").write_text(
        f"# Triton kernels compiled for {', '.join(targets)}\n\n{table}\n"
    )
    (args.out / "triton_compile.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    print(table)
    print(f"report: {args.out / 'triton_compile.md'}")
    spilling = [r for r in rows if r.required and r.spill_bytes]
    if spilling:
        sys.exit(f"{len(spilling)} fp16/bf16/fp32 specialisations spill registers (table above)")


if __name__ == "__main__":
    main(sys.argv[1:])

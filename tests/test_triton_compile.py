"""Every Triton kernel compiles for the GPU (sm_90, through Triton's own ptxas) on a machine without one.

The interpreter (tests/test_triton_ops.py) checks what the kernels compute, but it is plain Python: it does not
type-check loop-carried values, branches or constexpr folding the way the compiler does. Here the launches of a
few representative op calls are recorded while they run interpreted, and each recorded signature (argument
types and the constexprs, with ints equal to 1 specialised as Triton's launcher does) is compiled to a cubin for
an H100. The PTX is also checked for the numerics the kernels promise: no contracted multiply-adds in the box
kernels and IEEE round-to-nearest fp32 division.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from lit_amp_det.ops import triton as tops
from lit_amp_det.ops.triton import _launch
from ops_inputs import needs_extension, random_boxes, random_rois

pytestmark = needs_extension

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
_TORCH_TO_TRITON = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
                    torch.int64: "i64", torch.int32: "i32", torch.int8: "i8"}


def _compiled_kernels():
    """A copy of the kernels module decorated for compilation, whatever TRITON_INTERPRET said at first import."""
    spec = importlib.util.spec_from_file_location(
        "lit_amp_det.ops.triton._kernels_compile_check", importlib.util.find_spec(_launch._KERNELS_MODULE).origin
    )
    module = importlib.util.module_from_spec(spec)
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        spec.loader.exec_module(module)
    return module


def _record_launches(monkeypatch) -> list[tuple[str, tuple, dict]]:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = []
    run = _launch._launch

    def record(kernel, grid, *args, **meta):
        launches.append((kernel.fn.__name__, args, meta))
        return run(kernel, grid, *args, **meta)

    monkeypatch.setattr(_launch, "_launch", record)
    g = torch.Generator().manual_seed(0)
    boxes = random_boxes(70, image=(100, 100), max_size=50)
    scores = torch.rand(70, generator=g)
    tops.box_iou(boxes.half(), boxes[:5].half())
    tops.box_iou(boxes.long(), boxes[:5].long())
    tops.batched_nms(boxes.bfloat16(), scores, torch.randint(3, (70,), generator=g), 0.5, 10)
    tops.nms(boxes.double(), scores, 0.5)
    rois = random_rois(3, 2, (32, 32))
    for dtype, layout in ((torch.bfloat16, torch.channels_last), (torch.float64, torch.contiguous_format)):
        x = torch.randn(2, 4, 8, 8, dtype=dtype).contiguous(memory_format=layout).requires_grad_()
        tops.roi_align(x, rois.to(dtype), 2, 0.25, -1, True).sum().backward()
    features = [torch.randn(2, 4, 8, 8, requires_grad=True), torch.randn(2, 4, 4, 4, requires_grad=True)]
    tops.multi_level_roi_align(features, rois, torch.tensor([0, 1, 1]), [0.25, 0.125], 2, 2).sum().backward()
    torch.use_deterministic_algorithms(True)
    try:
        tops.roi_align(features[0], rois, 2, 0.25, 2).sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    return launches


def _signature(kernel, args: tuple, meta: dict) -> tuple[dict, dict]:
    signature, constexprs = {}, {}
    names = kernel.arg_names
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TORCH_TO_TRITON[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "u1"
        elif isinstance(value, int):
            if value == 1 and name not in kernel.do_not_specialize:
                signature[name], constexprs[name] = "constexpr", 1
            else:
                signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            raise TypeError(f"{kernel.__name__}: unexpected argument {name}={value!r}")
    for name in names[len(args):]:
        signature[name], constexprs[name] = "constexpr", meta[name]
    return signature, constexprs


def test_every_kernel_compiles_for_sm90_with_the_promised_numerics(monkeypatch):
    launches = _record_launches(monkeypatch)
    kernels = _compiled_kernels()
    assert {name for name, _, _ in launches} == {
        "box_iou_kernel", "nms_mask_kernel", "nms_greedy_kernel", "roi_align_forward_kernel",
        "roi_align_backward_atomic_kernel", "roi_align_backward_owned_kernel",
    }
    seen = set()
    for name, args, meta in launches:
        kernel = getattr(kernels, name)
        signature, constexprs = _signature(kernel, args, meta)
        key = (name, tuple(sorted(signature.items())), tuple(sorted((k, str(v)) for k, v in constexprs.items())))
        if key in seen:
            continue
        seen.add(key)
        options = {"enable_fp_fusion": False, "num_warps": meta.get("num_warps", 4)}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=H100, options=options)
        assert compiled.asm["cubin"], name
        ptx = compiled.asm["ptx"]
        if name in ("box_iou_kernel", "nms_mask_kernel"):
            assert not re.search(r"\bfma\.rn\.f(32|64)", ptx), f"{name}: a multiply-add was contracted"
            if "fp64" not in str(constexprs.get("ACC")):
                assert "div.rn.f32" in ptx and "div.full.f32" not in ptx, f"{name}: fp32 division is not IEEE"
    assert len(seen) >= 8


def _ptxas_usage(ptx: str, tmp_path) -> tuple[int, int]:
    """(registers, spill-store bytes) of one kernel, from Triton's own ``ptxas -v`` for sm_90a."""
    import subprocess

    source = tmp_path / "kernel.ptx"
    source.write_text(ptx)
    log = subprocess.run([triton.knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", str(source), "-o", "/dev/null"],
                         capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    return registers, sum(int(b) for b in re.findall(r"(\d+) bytes spill stores", log))


@pytest.mark.parametrize("pool", [7, 14])  # the box head's and the mask head's RoIAlign
def test_roi_align_kernels_do_not_spill_at_the_heads_sizes(monkeypatch, tmp_path, pool):
    """The forward and the atomic backward, with the blocks ``_blocks`` picks for a CUDA device at 256 channels, in
    every half and float dtype and both layouts: no spilled register, at most 128 registers per thread."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors stand in for the GPU's: the launches are recorded, not run
    launches = []
    monkeypatch.setattr(_launch, "_launch", lambda kernel, grid, *args, **meta: launches.append((kernel, args, meta)))
    block_p, block_c, warps = _launch._blocks(256, pool * pool, torch.device("cuda"))
    rois = torch.tensor([[0, 1.0, 1.0, 60.0, 40.0], [1, 5.0, 5.0, 90.0, 90.0]])
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for layout in (torch.contiguous_format, torch.channels_last):
            x = torch.randn(2, 256, 25, 38, dtype=dtype).contiguous(memory_format=layout)
            _launch._forward([x], rois.to(dtype), None, [0.25], pool, pool, 2, True)
            grad = torch.randn(2, 256, pool, pool, dtype=dtype)
            _launch._backward(grad, rois.to(dtype), None, [0.25], [(x.shape, layout)], pool, pool, 2, True)
    kernels = _compiled_kernels()
    assert len(launches) == 12
    for kernel, args, meta in launches:
        meta = {**meta, "BLOCK_P": block_p, "BLOCK_C": block_c, "num_warps": warps}
        name = kernel.fn.__name__
        signature, constexprs = _signature(getattr(kernels, name), args, meta)
        compiled = triton.compile(ASTSource(getattr(kernels, name), signature, constexprs=constexprs), target=H100,
                                  options={"enable_fp_fusion": False, "num_warps": warps})
        registers, spilled = _ptxas_usage(compiled.asm["ptx"], tmp_path)
        label = f"{name} {signature['x_ptr' if 'x_ptr' in signature else 'grad_ptr']} pool {pool}"
        assert spilled == 0, f"{label}: {spilled} bytes spilled ({registers} registers)"
        assert registers <= 128, f"{label}: {registers} registers"

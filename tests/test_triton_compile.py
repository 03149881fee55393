"""Every Triton kernel compiles for the GPU (sm_90, through Triton's own ptxas) on a machine without one.

The interpreter (tests/test_triton_ops.py) checks what the kernels compute, but it is plain Python: it does
not type-check loop-carried values, branches or constexpr folding the way the compiler does. Here the launches
of a few representative op calls are recorded while they run interpreted, and each is specialised as Triton's
launcher does and compiled to a cubin for an H100 (``tools/triton_compile.py``, which also reports registers
and spills: the model's launches must not spill). The PTX is also checked for the numerics the kernels
promise: no contracted multiply-adds in the box kernels and IEEE round-to-nearest fp32 division.
"""

from __future__ import annotations

import re

import pytest
import torch

from lit_amp_det.ops.triton import _launch
from ops_inputs import needs_extension, random_boxes, random_rois

pytestmark = needs_extension

triton = pytest.importorskip("triton")


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
    _launch.box_iou(boxes.half(), boxes[:5].half())
    _launch.box_iou(boxes.long(), boxes[:5].long())
    _launch.batched_nms(boxes.bfloat16(), scores, torch.randint(3, (70,), generator=g), 0.5, 10)
    _launch.nms(boxes.double(), scores, 0.5)
    rois = random_rois(3, 2, (32, 32))
    for dtype, layout in ((torch.bfloat16, torch.channels_last), (torch.float64, torch.contiguous_format)):
        x = torch.randn(2, 4, 8, 8, dtype=dtype).contiguous(memory_format=layout)
        _roi_align_and_backward(x, rois.to(dtype), 0.25, -1, True)
    features = [torch.randn(2, 4, 8, 8), torch.randn(2, 4, 4, 4)]
    levels, scales, args = torch.tensor([0, 1, 1]), [0.25, 0.125], (2, 2, 2, False)
    pooled = _launch.multi_level_roi_align(features, rois, levels, scales, *args)
    _launch.multi_level_roi_align_backward(torch.ones_like(pooled), features, rois, levels, scales, *args)
    torch.use_deterministic_algorithms(True)  # the owned (atomic-free) backward
    try:
        _roi_align_and_backward(features[0], rois, 0.25, 2, False)
    finally:
        torch.use_deterministic_algorithms(False)
    return launches


def _roi_align_and_backward(
    x: torch.Tensor,
    rois: torch.Tensor,
    scale: float,
    sampling_ratio: int,
    aligned: bool,
) -> None:
    """A 2 x 2 RoIAlign of ``x`` and its backward, launched as ``lit_amp_det.ops.roi_align`` runs them on
    CUDA.
    """
    pooled = _launch.roi_align(x, rois, scale, 2, 2, sampling_ratio, aligned)
    _launch.roi_align_backward(torch.ones_like(pooled), rois, scale, 2, 2, *x.shape, sampling_ratio, aligned)


def test_every_kernel_compiles_for_sm90_with_the_promised_numerics(monkeypatch):
    import triton_compile

    launches = [triton_compile.Launch(name, args, meta) for name, args, meta in _record_launches(monkeypatch)]
    kernels = triton_compile.compiled_kernels()
    assert {launch.kernel for launch in launches} == {
        "box_iou_kernel",
        "nms_mask_kernel",
        "nms_greedy_kernel",
        "roi_align_forward_kernel",
        "roi_align_backward_atomic_kernel",
        "roi_align_backward_owned_kernel",
    }
    distinct = triton_compile.specialisations(kernels, launches, "sm_90")
    for launch in distinct:
        compiled = triton_compile.compile_launch(kernels, launch, "sm_90")
        assert compiled.asm["cubin"], launch.kernel
        ptx = compiled.asm["ptx"]
        if launch.kernel in ("box_iou_kernel", "nms_mask_kernel"):
            assert not re.search(r"\bfma\.rn\.f(32|64)", ptx), (
                f"{launch.kernel}: a multiply-add was contracted"
            )
            if launch.dtype != torch.float64 and launch.meta.get("FP64") is not True:
                assert "div.rn.f32" in ptx and "div.full.f32" not in ptx, (
                    f"{launch.kernel}: fp32 division is not IEEE"
                )
    assert len(distinct) >= 8


@pytest.mark.slow
def test_the_models_launches_compile_without_spills_on_hopper_and_blackwell():
    """``make gpu-compile`` on a subset (the heads' pools at 256 channels, both layouts, NMS and IoU at the
    model's sizes, every model dtype): no fp16/bf16/fp32 specialisation spills on sm_90 or sm_100, and the
    memory-bound RoIAlign kernels stay within 128 registers a thread.
    """
    import triton_compile

    launches = triton_compile.model_launches(
        dtypes=triton_compile.MODEL_DTYPES, pools=(7, 14), channels=(256,)
    )
    assert {launch.kernel for launch in launches} == {
        "box_iou_kernel",
        "nms_mask_kernel",
        "nms_greedy_kernel",
        "roi_align_forward_kernel",
        "roi_align_backward_atomic_kernel",
        "roi_align_backward_owned_kernel",
    }
    kernels = triton_compile.compiled_kernels()
    for target in ("sm_90", "sm_100"):
        for launch in triton_compile.specialisations(kernels, launches, target):
            cost = triton_compile.usage(kernels, launch, target)
            label = f"{target} {cost.kernel} {cost.dtype} {cost.block} ({cost.num_warps} warps)"
            assert cost.spill_bytes == 0, (
                f"{label}: {cost.spill_bytes} bytes spilled at {cost.registers} registers"
            )
            if cost.kernel.startswith("roi_align"):
                assert cost.registers <= 128, f"{label}: {cost.registers} registers"


def test_the_compile_report_names_each_specialisation_once_at_its_worst():
    from triton_compile import Usage, report

    rows = [
        Usage("sm_90", "k", "float16", "BLOCK_C=8", 4, 80, 0, 0),
        Usage("sm_90", "k", "float16", "BLOCK_C=8", 4, 90, 0, 0),
        Usage("sm_90", "k", "float64", "BLOCK_C=8", 4, 128, 24, 0),
    ]
    table = report(rows)
    assert "| sm_90 | k | float16 | BLOCK_C=8 | 4 | 90 | 0 | 0 |" in table and "| 80 |" not in table
    assert "24 (fp64: may spill)" in table

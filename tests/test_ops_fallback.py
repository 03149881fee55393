"""Without the compiled extension, lit_amp_det imports, every op still works and one warning says how to
build.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

SCRIPT = textwrap.dedent(
    """
    import warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import torch, torchvision
        import lit_amp_det, lit_amp_det.ops as ops
        assert not ops.extension_available(), ops.extension_error()
        boxes = torch.rand(200, 4) * 100
        boxes[:, 2:] += boxes[:, :2]
        scores = torch.rand(200)
        idxs = torch.randint(3, (200,))
        assert torch.equal(ops.nms(boxes, scores, 0.5), torchvision.ops.nms(boxes, scores, 0.5))
        assert torch.equal(ops.batched_nms(boxes, scores, idxs, 0.5, 20),
                           torchvision.ops.batched_nms(boxes, scores, idxs, 0.5)[:20])
        torch.testing.assert_close(ops.box_iou(boxes, boxes), torchvision.ops.box_iou(boxes, boxes))
        x = torch.randn(2, 4, 32, 32, requires_grad=True)
        rois = torch.cat([torch.randint(2, (200, 1)).float(), boxes / 4], dim=1)
        expected = torchvision.ops.roi_align(x, rois, 7, 0.25, 2)
        torch.testing.assert_close(ops.roi_align(x, rois, 7, 0.25, 2), expected)
        levels = [x, x[:, :, ::2, ::2]]
        pooled = ops.multi_level_roi_align(levels, rois, idxs.clamp(max=1), [0.25, 0.125], 7, 2)
        pooled.sum().backward()
        assert x.grad.abs().sum() > 0
    messages = [
        str(w.message)
        for w in caught
        if issubclass(w.category, RuntimeWarning) and "lit_amp_det" in str(w.message)
    ]
    assert len(messages) == 1, messages
    assert "make install" in messages[0] and "LIT_AMP_DET_NO_EXT=1" in messages[0], messages[0]
    print("ok")
    """
)


def test_ops_fall_back_to_pure_pytorch_with_one_warning():
    env = {**os.environ, "LIT_AMP_DET_NO_EXT": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip().endswith("ok")


def test_the_extension_is_built_for_this_machine():
    """`make install` must leave a loadable extension (C++ CPU kernels, no nvcc involved), and the CUDA key of
    every op must hold the Triton kernels; otherwise every op test above would be skipped, not failed.
    """
    import importlib.util

    import torch

    import lit_amp_det.ops as ops
    from lit_amp_det.ops._extension import triton_cuda_kernels

    assert ops.extension_available(), (
        f"lit_amp_det._C failed to import: {ops.extension_error()}; run `make install`"
    )
    assert ops.compiled_cuda_version() == -1, (
        "lit_amp_det._C must hold no CUDA code: the CUDA kernels are Triton's"
    )
    if importlib.util.find_spec("triton") is not None:
        assert triton_cuda_kernels(), "triton is installed but its kernels were not registered for CUDA"
        assert torch._C._dispatch_has_kernel_for_dispatch_key("lit_amp_det::roi_align", "CUDA")


def test_the_extension_shares_torchs_cxx_runtime():
    """A ``TORCH_CHECK`` in a C++ kernel throws through torch's frames: with a private, statically linked copy
    of the C++ runtime (a toolchain whose ``g++`` has only ``libstdc++.a``) that crashes the process instead
    of raising. ``setup.py`` links the shared runtime torch loaded; the built ``_C`` must need it and define
    none of the runtime's throw machinery itself.
    """
    import shutil

    import lit_amp_det._C as extension

    if not sys.platform.startswith("linux") or shutil.which("nm") is None:
        pytest.skip("needs Linux and binutils' nm")
    defined = subprocess.run(
        ["nm", "-D", "--defined-only", extension.__file__], capture_output=True, text=True, check=True
    ).stdout
    assert " __cxa_throw" not in defined and "__gxx_personality_v0" not in defined, (
        f"{extension.__file__} carries its own C++ runtime: "
        "rebuild with `python setup.py build_ext --inplace`"
    )
    undefined = subprocess.run(
        ["nm", "-D", "--undefined-only", extension.__file__], capture_output=True, text=True, check=True
    ).stdout
    assert "__cxa_throw" in undefined, (
        "the extension throws no C++ exception at all: its kernels lost TORCH_CHECK"
    )

"""``lit_amp_det.ops.master_sgd_step_`` / ``all_finite`` and the fused master step of ``bf16-weights``.

The update is checked against ``torch.optim.SGD`` itself (foreach and fused kernels) over its options -- momentum,
dampening, nesterov, weight decay, maximize -- for bf16/fp16/fp32 gradients, contiguous and channels_last
layouts and the first (buffer-creating) step; the compiled kernel against the plain-PyTorch reference; the
plugin's fused step against its unfused (hooks) step on the smoke Mask R-CNN, with and without clipping.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

from lit_amp_det.ops import reference
from lit_amp_det.ops._extension import extension_available
from lit_amp_det.ops.optim_step import all_finite, master_sgd_step_

needs_ext = pytest.mark.skipif(not extension_available(), reason="the compiled extension is not built")

_OPTIONS = [  # momentum, dampening, nesterov, weight_decay, maximize
    (0.9, 0.0, False, 1e-4, False),
    (0.0, 0.0, False, 0.0, False),
    (0.0, 0.0, False, 1e-2, True),
    (0.9, 0.0, True, 1e-4, False),
    (0.5, 0.1, False, 1e-2, True),
]
_SHAPES = {"conv3x3": (32, 16, 3, 3), "conv1x1": (64, 32, 1, 1), "linear": (40, 70), "bias": (33,), "scalar": ()}


def _layout(t: Tensor, channels_last: bool) -> Tensor:
    return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t


def _run_ours(values: dict[str, Tensor], grads: list[dict[str, Tensor]], low_dtype, options, lr, impl):
    momentum, dampening, nesterov, weight_decay, maximize = options
    masters = [v.clone(memory_format=torch.preserve_format) for v in values.values()]
    lows = [m.to(low_dtype) for m in masters] if low_dtype is not None else []
    buffers = [torch.empty_like(m) for m in masters] if momentum else []
    for step, grad in enumerate(grads):
        impl(masters, list(grad.values()), buffers, lows, lr, momentum, dampening, weight_decay, nesterov, maximize,
             1.0, step == 0)
    return masters, lows, buffers


def _run_torch(values: dict[str, Tensor], grads: list[dict[str, Tensor]], options, lr, kernel: str):
    momentum, dampening, nesterov, weight_decay, maximize = options
    params = [torch.nn.Parameter(v.clone(memory_format=torch.preserve_format)) for v in values.values()]
    flags = {"fused": True} if kernel == "fused" else {"foreach": kernel == "foreach"}
    optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
                                weight_decay=weight_decay, maximize=maximize, **flags)
    for grad in grads:
        for param, g in zip(params, grad.values()):
            param.grad = g.float()
        optimizer.step()
    return [p.detach() for p in params], [optimizer.state[p].get("momentum_buffer") for p in params]


def _problem(grad_dtype: torch.dtype, channels_last: bool, steps: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    values = {k: _layout(torch.randn(s, generator=gen), channels_last) for k, s in _SHAPES.items()}
    grads = [{k: _layout(torch.randn(s, generator=gen).to(grad_dtype), channels_last) for k, s in _SHAPES.items()}
             for _ in range(steps)]
    return values, grads


def _compiled(*args) -> None:
    torch.ops.lit_amp_det.master_sgd_step_(*args)


_IMPLS = {"compiled": pytest.param(_compiled, marks=needs_ext), "reference": reference.master_sgd_step_}


@pytest.mark.parametrize("impl", list(_IMPLS.values()), ids=list(_IMPLS))
@pytest.mark.parametrize("options", _OPTIONS, ids=lambda o: f"m{o[0]}-d{o[1]}-n{int(o[2])}-wd{o[3]}-max{int(o[4])}")
@pytest.mark.parametrize("grad_dtype,low_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                                  (torch.float32, None)], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_step_equals_torch_sgd(impl, options, grad_dtype, low_dtype, channels_last: bool) -> None:
    values, grads = _problem(grad_dtype, channels_last)
    masters, lows, buffers = _run_ours(values, grads, low_dtype, options, 0.05, impl)
    for kernel in ("foreach", "for-loop", "fused"):
        expected, expected_buffers = _run_torch(values, grads, options, 0.05, kernel)
        for name, master, want in zip(values, masters, expected):
            torch.testing.assert_close(master, want, rtol=1e-6, atol=1e-6, msg=f"{kernel} {name}")
            assert master.stride() == values[name].stride()  # written in place, layout kept
        for buffer, want in zip(buffers, expected_buffers):
            torch.testing.assert_close(buffer, want, rtol=1e-6, atol=1e-6)
    for low, master in zip(lows, masters):  # the weight is the new master rounded, exactly
        assert torch.equal(low, master.to(low.dtype))


@needs_ext
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiled_kernel_equals_reference_at_real_sizes(grad_dtype: torch.dtype) -> None:
    """A 256x256x3x3 channels_last conv weight and a 1024x12544 FC weight: several threads' ranges, chunk tails."""
    gen = torch.Generator().manual_seed(1)
    shapes = [(256, 256, 3, 3), (1024, 12544), (1000_003,)]
    masters = [_layout(torch.randn(s, generator=gen), True) for s in shapes]
    grads = [_layout(torch.randn(s, generator=gen), True).to(grad_dtype) for s in shapes]
    runs = []
    for impl in (_compiled, reference.master_sgd_step_):
        m = [t.clone(memory_format=torch.preserve_format) for t in masters]
        b = [torch.full_like(t, 0.5) for t in masters]
        w = [t.to(torch.bfloat16) for t in masters]
        impl(m, grads, b, w, 0.02, 0.9, 0.0, 1e-4, False, False, 0.5, False)
        runs.append((m, b, w))
        for master, weight in zip(m, w):  # each implementation's weight is its new master rounded, exactly
            assert torch.equal(weight, master.to(torch.bfloat16))
    # masters and momentum buffers agree to fp32 rounding (the kernel's FMAs round once where torch's ops may round
    # twice). The bf16 weights are not compared with each other: where a master sits within one fp32 rounding of a
    # bf16 midpoint the two round to neighbouring bf16 values (1-15 of 2.2 M elements on an AVX2 CPU)
    for ours, ref in zip(*[list(itertools.chain(r[0], r[1])) for r in runs]):
        torch.testing.assert_close(ours, ref, rtol=2e-7, atol=2e-7)


def test_grad_scale_multiplies_the_gradient_first() -> None:
    """``grad_scale`` is what clipping (or unscaling) does to the fp32 gradient before SGD sees it."""
    values, grads = _problem(torch.bfloat16, False, steps=1)
    masters = [v.clone() for v in values.values()]
    master_sgd_step_(masters, list(grads[0].values()), [torch.empty_like(m) for m in masters], lr=0.1,
                     momentum=0.9, weight_decay=1e-4, grad_scale=0.25, first_step=True)
    scaled = [{k: g.float() * 0.25 for k, g in grads[0].items()}]
    expected, _ = _run_torch(values, scaled, (0.9, 0.0, False, 1e-4, False), 0.1, "for-loop")
    for got, want in zip(masters, expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@needs_ext
def test_empty_tensors_and_a_grad_in_another_layout_are_checked() -> None:
    op = torch.ops.lit_amp_det.master_sgd_step_
    empty = torch.empty(0, 3)
    op([empty], [empty.bfloat16()], [empty.clone()], [empty.bfloat16()], 0.1, 0.9, 0.0, 0.0, False, False, 1.0, True)
    master = torch.randn(8, 4, 3, 3).contiguous(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match=r"grads\[0\] must be dense with the shape and memory order of params\[0\]"):
        op([master], [torch.randn(8, 4, 3, 3).bfloat16()], [], [], 0.1, 0.0, 0.0, 0.0, False, False, 1.0, False)
    with pytest.raises(RuntimeError, match=r"params\[0\] must be float32"):
        op([master.double()], [master.double()], [], [], 0.1, 0.0, 0.0, 0.0, False, False, 1.0, False)
    with pytest.raises(RuntimeError, match="1 params but 2 grads"):
        op([master], [master, master], [], [], 0.1, 0.0, 0.0, 0.0, False, False, 1.0, False)
    with pytest.raises(RuntimeError, match="needs one momentum buffer per param"):
        op([master], [master], [], [], 0.1, 0.9, 0.0, 0.0, False, False, 1.0, False)
    with pytest.raises(RuntimeError, match="nesterov needs momentum > 0 and dampening 0"):
        op([master], [master], [master.clone()], [], 0.1, 0.9, 0.1, 0.0, True, False, 1.0, False)
    one_by_one = torch.randn(16, 8, 1, 1)  # the same bytes as its channels_last twin: strides differ on size-1 dims
    grad = one_by_one.contiguous(memory_format=torch.channels_last).bfloat16()
    op([one_by_one], [grad], [], [], 0.1, 0.0, 0.0, 0.0, False, False, 1.0, False)


@needs_ext
def test_opcheck_schema_and_fake_kernels() -> None:
    params = [torch.randn(4, 3), torch.randn(5)]
    args = (params, [p.bfloat16() for p in params], [torch.zeros_like(p) for p in params],
            [p.bfloat16() for p in params], 0.1, 0.9, 0.0, 1e-4, False, False, 1.0, False)
    torch.library.opcheck(torch.ops.lit_amp_det.master_sgd_step_.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.lit_amp_det.all_finite.default, ([torch.randn(3), torch.randn(2).bfloat16()],),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("use_reference", [False, True], ids=["compiled", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_all_finite(dtype: torch.dtype, use_reference: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if use_reference:
        monkeypatch.setattr("lit_amp_det.ops.optim_step.extension_available", lambda: False)
    elif not extension_available():
        pytest.skip("the compiled extension is not built")
    finite = torch.randn(300_001).to(dtype)
    assert all_finite([finite, torch.arange(5), torch.empty(0, dtype=dtype)])
    assert all_finite([])
    extreme = torch.tensor([torch.finfo(dtype).max, -torch.finfo(dtype).max, torch.finfo(dtype).tiny], dtype=dtype)
    assert all_finite([extreme])
    for bad in (float("inf"), float("-inf"), float("nan")):
        poisoned = finite.clone()
        poisoned[123_457] = bad
        assert not all_finite([finite, poisoned]), bad
        strided = poisoned.reshape(-1, 1)[::1].expand(-1, 2)[:, :1]  # a view that is not dense
        assert not all_finite([strided]), bad
        channels_last = torch.zeros(2, 3, 4, 5, dtype=dtype).contiguous(memory_format=torch.channels_last)
        channels_last[1, 2, 3, 4] = bad
        assert not all_finite([channels_last])


def test_fused_step_is_taken_only_where_the_compiled_kernel_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from lit_amp_det.precision import fused_master_step

    params = [torch.nn.Parameter(torch.randn(3))]
    assert fused_master_step.unfused_reason(torch.optim.AdamW(params)) == "AdamW is not torch.optim.SGD"
    sgd = torch.optim.SGD(params, lr=0.1)
    float64 = torch.optim.SGD([torch.nn.Parameter(torch.randn(2).double())], lr=0.1)
    if extension_available():
        assert fused_master_step.unfused_reason(float64) == "param_groups[0] holds a torch.float64 parameter"
    monkeypatch.setattr(fused_master_step, "extension_available", lambda: False)
    assert "not built" in fused_master_step.unfused_reason(sgd)
    monkeypatch.undo()
    if extension_available():
        assert fused_master_step.unfused_reason(sgd) is None
        differentiable = torch.optim.SGD(params, lr=0.1, differentiable=True)
        assert fused_master_step.unfused_reason(differentiable) == "param_groups[0] has differentiable=True"
    meta = torch.optim.SGD([torch.nn.Parameter(torch.randn(2, device="meta"))], lr=0.1)
    if extension_available():
        assert "on meta" in fused_master_step.unfused_reason(meta)

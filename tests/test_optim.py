"""Warm-up schedules and optimizer construction."""

from __future__ import annotations

import pytest
import torch

from lit_amp_det.optim import build_optimizer, warmup_schedule


def _lrs(steps: int, **kwargs) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = warmup_schedule(opt, total_steps=steps, **kwargs)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_linear_warmup_then_multistep_by_fraction() -> None:
    lrs = _lrs(100, warmup_steps=10, warmup_factor=0.1, milestones=(0.5, 0.8), gamma=0.1)
    assert lrs[0] == pytest.approx(0.1)
    assert lrs[5] == pytest.approx(0.1 * 0.5 + 0.5)
    assert lrs[10] == pytest.approx(1.0) and lrs[49] == pytest.approx(1.0)
    assert lrs[50] == pytest.approx(0.1) and lrs[80] == pytest.approx(0.01)


def test_absolute_milestones_and_fractional_warmup() -> None:
    lrs = _lrs(100, warmup_steps=0.1, warmup_factor=0.0, milestones=(30,), gamma=0.5)
    assert lrs[0] == 0.0 and lrs[10] == pytest.approx(1.0)
    assert lrs[29] == pytest.approx(1.0) and lrs[30] == pytest.approx(0.5)


def test_cosine_reaches_its_floor() -> None:
    lrs = _lrs(100, warmup_steps=0, policy="cosine", min_lr_ratio=0.1)
    assert lrs[0] == pytest.approx(1.0) and lrs[50] == pytest.approx(0.55)
    assert lrs[99] == pytest.approx(0.1, abs=1e-3) and lrs == sorted(lrs, reverse=True)


def test_bad_policy_and_steps() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match="policy='step'"):
        warmup_schedule(opt, total_steps=10, policy="step")
    with pytest.raises(ValueError, match="total_steps must be >= 1"):
        warmup_schedule(opt, total_steps=0)


def test_fused_auto_resolves_on_cpu() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = build_optimizer({"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "fused": "auto"}, params)
    assert opt.defaults["fused"] is True
    opt = build_optimizer({"_target_": "torch.optim.AdamW", "lr": 0.1, "fused": None}, params)
    assert not opt.defaults.get("fused")
    with pytest.raises(ValueError, match="needs a _target_"):
        build_optimizer({"lr": 0.1}, params)

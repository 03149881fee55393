"""Warm-up schedules, optimizer construction and the linear lr scaling with the global batch."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate

from lit_amp_det.optim import build_optimizer, check_reference_batch, global_batch_size, scale_lr, warmup_schedule

from conftest import compose_config


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


def test_lr_scales_linearly_with_the_global_batch() -> None:
    config = {"_target_": "torch.optim.SGD", "lr": 0.02, "momentum": 0.9}
    assert scale_lr(config, 2, 16) == {"_target_": "torch.optim.SGD", "lr": pytest.approx(0.0025), "momentum": 0.9}
    assert scale_lr(config, 32, 16)["lr"] == pytest.approx(0.04) and config["lr"] == 0.02  # a copy
    assert global_batch_size(2, 8, 1) == 16 and global_batch_size(2, 4, 3) == 24
    with pytest.raises(ValueError, match=r"^reference_batch=0 must be a positive integer"):
        scale_lr(config, 2, 0)
    with pytest.raises(ValueError, match=r"^reference_batch=16.0 must be a positive integer"):
        check_reference_batch(16.0)
    with pytest.raises(ValueError, match=r"optim.reference_batch=16 scales optimizer.lr, but the optimizer config "
                                         r"has no lr"):
        scale_lr({"_target_": "torch.optim.SGD"}, 2, 16)
    with pytest.raises(ValueError, match="trainer.accumulate_grad_batches must be >= 1"):
        global_batch_size(2, 1, 0)


def _configured_lr(tmp_path: Path, reference: str, trainer: SimpleNamespace) -> float:
    cfg = compose_config(["model=maskrcnn_tiny", "optim=sgd", "optim.optimizer.lr=0.02",
                          f"optim.reference_batch={reference}"], tmp_path)
    module = instantiate(cfg.model, num_classes=3)
    module._trainer = trainer  # what configure_optimizers reads of the Trainer
    return module.configure_optimizers()["optimizer"].param_groups[0]["initial_lr"]


def test_module_scales_lr_by_batch_devices_nodes_and_accumulation(tmp_path: Path) -> None:
    def trainer(batch_size: int | None, world_size: int, accumulate: int) -> SimpleNamespace:
        datamodule = SimpleNamespace(batch_size=batch_size) if batch_size else None
        return SimpleNamespace(datamodule=datamodule, world_size=world_size, accumulate_grad_batches=accumulate,
                               estimated_stepping_batches=100, is_global_zero=True)

    # 2 images x 8 processes (devices x nodes) x 2 accumulated batches = 32 images per step: twice the reference
    assert _configured_lr(tmp_path, "16", trainer(2, 8, 2)) == pytest.approx(0.04)
    assert _configured_lr(tmp_path, "16", trainer(2, 1, 1)) == pytest.approx(0.0025)
    assert _configured_lr(tmp_path, "null", trainer(2, 8, 2)) == pytest.approx(0.02)  # today's behaviour
    with pytest.raises(ValueError, match="the per-device batch size is unknown"):
        _configured_lr(tmp_path, "16", trainer(None, 1, 1))

"""Warm-up schedules, optimizer construction and the linear lr scaling with the global batch."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate

from conftest import compose_config
from lit_amp_det.optim import (
    align_with_params,
    build_optimizer,
    check_reference_batch,
    global_batch_size,
    scale_lr,
    warmup_schedule,
)


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
    with pytest.raises(ValueError, match=r"total_steps\b"):
        warmup_schedule(opt, total_steps=0)


def test_fused_auto_resolves_on_cpu() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    opt = build_optimizer(
        {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "fused": "auto"}, params
    )
    assert opt.defaults["fused"] is True
    opt = build_optimizer({"_target_": "torch.optim.AdamW", "lr": 0.1, "fused": None}, params)
    assert not opt.defaults.get("fused")
    with pytest.raises(ValueError, match="needs a _target_"):
        build_optimizer({"lr": 0.1}, params)


def test_lr_scales_linearly_with_the_global_batch() -> None:
    config = {"_target_": "torch.optim.SGD", "lr": 0.02, "momentum": 0.9}
    assert scale_lr(config, 2, 16) == {
        "_target_": "torch.optim.SGD",
        "lr": pytest.approx(0.0025),
        "momentum": 0.9,
    }
    assert scale_lr(config, 32, 16)["lr"] == pytest.approx(0.04) and config["lr"] == 0.02  # a copy
    assert global_batch_size(2, 8, 1) == 16 and global_batch_size(2, 4, 3) == 24
    with pytest.raises(ValueError, match=r"^reference_batch=0 "):
        scale_lr(config, 2, 0)
    with pytest.raises(ValueError, match=r"^reference_batch=16\.0 "):
        check_reference_batch(16.0)
    with pytest.raises(
        ValueError,
        match=r"optim\.reference_batch=16 .*optimizer\.lr",
    ):
        scale_lr({"_target_": "torch.optim.SGD"}, 2, 16)
    with pytest.raises(ValueError, match=r"trainer\.accumulate_grad_batches\b"):
        global_batch_size(2, 1, 0)


def _configured_lr(tmp_path: Path, reference: str, trainer: SimpleNamespace) -> float:
    cfg = compose_config(
        ["model=maskrcnn_tiny", "optim=sgd", "optim.optimizer.lr=0.02", f"optim.reference_batch={reference}"],
        tmp_path,
    )
    module = instantiate(cfg.model, num_classes=3)
    module._trainer = trainer  # what configure_optimizers reads of the Trainer
    return module.configure_optimizers()["optimizer"].param_groups[0]["initial_lr"]


def test_module_scales_lr_by_batch_devices_nodes_and_accumulation(tmp_path: Path) -> None:
    def trainer(batch_size: int | None, world_size: int, accumulate: int) -> SimpleNamespace:
        datamodule = SimpleNamespace(batch_size=batch_size) if batch_size else None
        return SimpleNamespace(
            datamodule=datamodule,
            world_size=world_size,
            accumulate_grad_batches=accumulate,
            estimated_stepping_batches=100,
            is_global_zero=True,
        )

    # 2 images x 8 processes (devices x nodes) x 2 accumulated batches = 32 images per step: twice the
    # reference
    assert _configured_lr(tmp_path, "16", trainer(2, 8, 2)) == pytest.approx(0.04)
    assert _configured_lr(tmp_path, "16", trainer(2, 1, 1)) == pytest.approx(0.0025)
    assert _configured_lr(tmp_path, "null", trainer(2, 8, 2)) == pytest.approx(0.02)  # today's behaviour
    with pytest.raises(ValueError, match="the per-device batch size is unknown"):
        _configured_lr(tmp_path, "16", trainer(None, 1, 1))


CL = torch.channels_last
NCHW = torch.contiguous_format
#: Two runs of torch's fused CPU SGD/AdamW: steps in one memory layout, state saved, resumed under the other.
RESUMES = [(NCHW, CL), (CL, NCHW)]


def _resumed_run(
    optimizer_cfg: dict, before: torch.memory_format, after: torch.memory_format, build: bool = True
) -> torch.Tensor:
    """Two steps on a ``before``-laid-out 4-D parameter, its optimizer state saved; then a fresh parameter
    laid out ``after`` with that state loaded (what resuming a checkpoint after toggling
    ``model.channels_last`` does), two more steps. ``build``: optimizers from :func:`build_optimizer`, else
    instantiated as the config says.
    """
    torch.manual_seed(3)
    start = torch.randn(16, 8, 3, 3)
    grads = [torch.randn(16, 8, 3, 3) for _ in range(4)]

    def make(param: torch.nn.Parameter) -> torch.optim.Optimizer:
        if build:
            return build_optimizer(optimizer_cfg, [param])
        return instantiate({k: v for k, v in optimizer_cfg.items() if v != "auto"}, params=[param])

    param = torch.nn.Parameter(start.contiguous(memory_format=before))
    optimizer = make(param)
    for grad in grads[:2]:
        param.grad = grad.contiguous(memory_format=before)
        optimizer.step()
    saved = optimizer.state_dict()
    resumed = torch.nn.Parameter(param.detach().clone().contiguous(memory_format=after))
    optimizer = make(resumed)
    optimizer.load_state_dict(saved)
    for grad in grads[2:]:
        resumed.grad = grad.contiguous(memory_format=after)
        optimizer.step()
    return resumed.detach().contiguous()


SGD = {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4}
ADAMW = {"_target_": "torch.optim.AdamW", "lr": 0.01, "weight_decay": 1e-2}


@pytest.mark.parametrize(
    ("before", "after"), RESUMES, ids=["nchw-then-channels_last", "channels_last-then-nchw"]
)
@pytest.mark.parametrize("config", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_fused_steps_after_resuming_in_another_layout(
    config: dict, before: torch.memory_format, after: torch.memory_format
) -> None:
    """A fused optimizer from build_optimizer resumed under the other memory layout steps exactly as the
    for-loop implementation does, aligned by the pre-hook build_optimizer gives it. PyTorch's fused SGD and
    AdamW alone do not (the loaded state keeps the old layout, and their CPU kernels pair the tensors by
    memory order): that is asserted too, so this test notices when PyTorch fixes it.
    """
    expected = _resumed_run({**config, "foreach": False}, before, after, build=False)
    fused = {**config, "fused": "auto"}
    torch.testing.assert_close(_resumed_run(fused, before, after), expected, rtol=1e-6, atol=1e-6)
    plain_fused = _resumed_run({**config, "fused": True}, before, after, build=False)
    assert (plain_fused - expected).abs().max() > 1e-3, (  # SGD: 1.19, AdamW: 0.027 on parameters of about 4
        f"torch {torch.__version__}'s fused {config['_target_']} now steps mixed layouts right: the "
        "alignment hook of lit_amp_det.optim.build_optimizer may go"
    )


def test_alignment_copies_only_what_differs() -> None:
    """align_with_params leaves tensors already in their parameter's order alone (the same objects), copies
    the others into it, and counts the copies; scalar state (Adam's ``step``) is left alone.
    """
    param = torch.nn.Parameter(torch.randn(4, 3, 2, 2).contiguous(memory_format=CL))
    optimizer = torch.optim.AdamW([param], lr=0.01)
    param.grad = torch.randn(4, 3, 2, 2).contiguous(memory_format=CL)
    optimizer.step()
    state = optimizer.state[param]
    kept = {key: state[key] for key in ("exp_avg", "exp_avg_sq", "step")}
    assert align_with_params(optimizer) == 0
    assert all(state[key] is value for key, value in kept.items()) and param.grad.is_contiguous(
        memory_format=CL
    )
    state["exp_avg"] = state["exp_avg"].contiguous()
    param.grad = param.grad.contiguous()
    values = state["exp_avg"].clone(), param.grad.clone()
    assert align_with_params(optimizer) == 2
    assert state["exp_avg"].is_contiguous(memory_format=CL) and param.grad.is_contiguous(memory_format=CL)
    assert torch.equal(state["exp_avg"], values[0]) and torch.equal(param.grad, values[1])
    assert state["exp_avg_sq"] is kept["exp_avg_sq"] and state["step"] is kept["step"]


def test_only_fused_optimizers_get_the_alignment_hook() -> None:
    param = torch.nn.Parameter(torch.randn(2, 2))
    fused = build_optimizer({**SGD, "fused": "auto"}, [param])
    assert type(fused) is torch.optim.SGD and len(fused._optimizer_step_pre_hooks) == 1
    assert len(build_optimizer({**SGD, "fused": None}, [param])._optimizer_step_pre_hooks) == 0

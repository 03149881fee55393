"""The fused optimizers that step in memory order (lit_amp_det.optim.SGD/Adam/AdamW): torch's update bit for bit,
without PyTorch's per-step gradient copy, with hooks, closures, GradScaler and errors seeing the model's layout."""

from __future__ import annotations

import pytest
import torch

from lit_amp_det import optim
from lit_amp_det.optim import build_optimizer, memory_order_views

CL = torch.channels_last
CONFIGS = {
    "sgd-nesterov": {"_target_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4,
                     "nesterov": True},
    "sgd-dampened-maximize": {"_target_": "torch.optim.SGD", "lr": 0.05, "momentum": 0.5, "dampening": 0.3,
                              "maximize": True},
    "sgd-no-momentum": {"_target_": "torch.optim.SGD", "lr": 0.1},
    "adam-amsgrad": {"_target_": "torch.optim.Adam", "lr": 0.01, "amsgrad": True, "weight_decay": 1e-3},
    "adamw": {"_target_": "torch.optim.AdamW", "lr": 0.01, "weight_decay": 1e-2},
}
#: channels_last convolution weights, a 1x1 one (whose two layouts share strides where it matters), an NCHW one,
#: a bias; the last has no gradient on odd steps
SHAPES = [((16, 8, 3, 3), CL), ((8, 4, 1, 1), CL), ((12, 6, 3, 3), torch.contiguous_format), ((16,), None),
          ((6, 5, 2, 2), CL)]


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(5)
    return [torch.nn.Parameter(torch.randn(shape) if fmt is None else torch.randn(shape).contiguous(memory_format=fmt))
            for shape, fmt in SHAPES]


def _set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for index, param in enumerate(params):
        grad = torch.randn(param.shape, generator=generator)
        param.grad = None if (index == len(params) - 1 and step % 2) else torch.empty_like(param).copy_(grad)


def _run(config: dict, views: bool | None, steps: int = 4) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """``steps`` steps of ``config`` fused: built with memory-order views on/off, or (None) torch's class as is."""
    params = _params()
    if views is None:
        optimizer = torch.optim.__dict__[config["_target_"].rpartition(".")[2]](
            params, **{k: v for k, v in config.items() if k != "_target_"}, fused=True)
    else:
        optimizer = build_optimizer({**config, "fused": "auto", "memory_order_views": views}, params)
    for step in range(steps):
        _set_grads(params, step)
        optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("name", CONFIGS)
def test_same_update_bit_for_bit_as_torchs_fused_step(name: str) -> None:
    """Parameters and every state tensor equal torch's own fused optimizer's exactly, over steps that create the
    state, skip a parameter and continue it, and the state keeps its parameter's layout."""
    config = CONFIGS[name]
    expected_params, expected = _run(config, None)
    params, optimizer = _run(config, True)
    assert type(optimizer) is optim.memory_order.MEMORY_ORDER_STEPS[type(expected)]
    for param, want, want_param in zip(params, expected.param_groups[0]["params"], expected_params):
        assert param.stride() == want_param.stride() and torch.equal(param, want_param)
        state, want_state = optimizer.state[param], expected.state[want]
        assert state.keys() == want_state.keys()
        for key, value in state.items():
            assert torch.equal(value, want_state[key]), key
            if value.shape == param.shape:
                assert value.stride() == param.stride(), key


def _copied_shapes(step) -> list[tuple[int, ...]]:
    """The shapes of the tensors ``step()`` copies (``aten::copy_``/``clone`` as the profiler records them, kernels'
    internal calls included)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    return [tuple(event.input_shapes[0]) for event in prof.events()
            if event.name in ("aten::copy_", "aten::clone") and event.input_shapes and event.input_shapes[0]]


@pytest.mark.parametrize("name", ["sgd-nesterov", "adamw"])
def test_no_gradient_is_copied(name: str) -> None:
    """The step copies nothing (after the first, which makes the state). Torch's own fused step copies each
    channels_last gradient: asserted too, so this test notices when PyTorch drops that copy."""
    counts = []
    for views in (True, None):
        _, optimizer = _run(CONFIGS[name], views, steps=1)
        for param in optimizer.param_groups[0]["params"]:
            param.grad = torch.ones_like(param)
        counts.append(_copied_shapes(optimizer.step))
    ours, torchs = counts
    assert ours == []
    assert (16, 8, 3, 3) in torchs and (6, 5, 2, 2) in torchs, (
        f"torch {torch.__version__}'s fused {CONFIGS[name]['_target_']} no longer copies channels_last gradients "
        f"({torchs}): lit_amp_det.optim.memory_order_views may go")


def test_hooks_and_closure_see_the_models_layout() -> None:
    """The closure runs first (a real forward and backward on the real weights), the step hooks run around the
    step; all of them see the parameters as the model does, and step returns the closure's loss."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=CL)
    image = torch.randn(2, 3, 6, 6).contiguous(memory_format=CL)
    expected_loss = conv(image).square().mean().item()
    optimizer = build_optimizer({**CONFIGS["sgd-nesterov"], "fused": "auto"}, list(conv.parameters()))
    seen = []

    def check(label: str) -> None:
        seen.append((label, conv.weight.stride(), conv.weight.grad.stride() if conv.weight.grad is not None else None))

    optimizer.register_step_pre_hook(lambda *_: check("pre"))
    optimizer.register_step_post_hook(lambda *_: check("post"))

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = conv(image).square().mean()
        loss.backward()
        check("closure")
        return loss

    before = conv.weight.detach().clone()
    loss = optimizer.step(closure)
    assert loss.item() == pytest.approx(expected_loss)
    strides = conv.weight.stride()
    assert strides == (27, 1, 9, 3)
    assert seen == [("pre", strides, None), ("closure", strides, strides), ("post", strides, strides)]
    reference = torch.optim.SGD([torch.nn.Parameter(before)], lr=0.1, momentum=0.9, weight_decay=1e-4,
                                nesterov=True)
    reference.param_groups[0]["params"][0].grad = conv.weight.grad.contiguous()
    reference.step()
    torch.testing.assert_close(conv.weight.detach(), reference.param_groups[0]["params"][0].detach())


def test_an_error_in_the_step_leaves_the_tensors_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    params, optimizer = _run(CONFIGS["sgd-nesterov"], True, steps=1)
    _set_grads(params, 1)
    before = [(p.detach().clone(), p.stride(), p.grad, optimizer.state[p]["momentum_buffer"].stride())
              for p in params if p.grad is not None]

    def broken(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(torch, "_fused_sgd_", broken)
    with pytest.raises(RuntimeError, match="kernel failed"):
        optimizer.step()
    after = [p for p in params if p.grad is not None]
    for param, (values, strides, grad, buffer_strides) in zip(after, before):
        assert param.stride() == strides and torch.equal(param, values) and param.grad is grad
        assert optimizer.state[param]["momentum_buffer"].stride() == buffer_strides


def test_views_pair_the_same_elements_and_leave_other_tensors_alone() -> None:
    """Inside, a channels_last parameter, its gradient and state are contiguous views of their own memory; a
    tensor in another memory order (a state tensor nobody aligned) keeps its parameter out of the views."""
    params = _params()
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
    _set_grads(params, 0)
    optimizer.step()
    first, nchw, last = params[0], params[2], params[4]
    optimizer.state[last]["momentum_buffer"] = optimizer.state[last]["momentum_buffer"].contiguous()
    storage = first.data_ptr()
    with memory_order_views(optimizer) as viewed:
        assert viewed == 1  # the 1x1 weight counts as contiguous, the NCHW one is, the last one is mismatched
        assert first.is_contiguous() and first.grad.is_contiguous() and first.data_ptr() == storage
        assert optimizer.state[first]["momentum_buffer"].is_contiguous()
        assert nchw.is_contiguous() and last.is_contiguous(memory_format=CL)
    assert first.is_contiguous(memory_format=CL) and not first.is_contiguous()
    assert optimizer.state[first]["momentum_buffer"].is_contiguous(memory_format=CL)


def test_grad_scaler_steps_and_skips_as_with_torchs_optimizer() -> None:
    """GradScaler hands fused optimizers ``grad_scale``/``found_inf``: unscaled inside the kernel, and an inf
    gradient skips the step, as with torch's own class."""
    results = []
    for views in (True, None):
        params, optimizer = _run(CONFIGS["adamw"], views, steps=1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        for step, poison in ((1, False), (2, True), (3, False)):
            _set_grads(params, step)
            factor = scaler.scale(torch.ones(()))  # what scaling the loss does to every gradient
            for param in params:
                if param.grad is not None:
                    param.grad.mul_(factor)
            if poison:
                params[0].grad[0, 0, 0, 0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
        results.append([p.detach().clone() for p in params])
    for ours, torchs in zip(*results):
        assert torch.equal(ours, torchs)


def test_build_optimizer_picks_the_memory_order_classes() -> None:
    param = torch.nn.Parameter(torch.randn(2, 2))
    sgd = CONFIGS["sgd-nesterov"]
    assert type(build_optimizer({**sgd, "fused": "auto"}, [param])) is optim.SGD
    assert type(build_optimizer({**CONFIGS["adamw"], "fused": True}, [param])) is optim.AdamW
    assert type(build_optimizer({**sgd, "fused": "auto", "memory_order_views": False}, [param])) is torch.optim.SGD
    assert type(build_optimizer({**sgd, "fused": None}, [param])) is torch.optim.SGD
    assert type(build_optimizer({"_target_": torch.optim.Adam, "fused": True}, [param])) is optim.Adam
    assert type(build_optimizer({"_target_": "torch.optim.Adagrad", "fused": True}, [param])) is torch.optim.Adagrad
    with pytest.raises(ValueError, match="memory_order_views"):
        build_optimizer({**sgd, "memory_order_views": "yes"}, [param])
    # a function that makes the optimizer is a target too, and an unknown one is instantiate's error to report
    made = build_optimizer({"_target_": "test_optim_memory_order.make_sgd", "fused": True}, [param])
    assert type(made) is torch.optim.SGD and made.defaults["fused"] is True
    with pytest.raises(Exception, match="no_such_optimizer"):
        build_optimizer({"_target_": "torch.optim.no_such_optimizer", "fused": True}, [param])


def make_sgd(params, fused: bool) -> torch.optim.SGD:
    """An optimizer factory (a function target) for the test above."""
    return torch.optim.SGD(params, lr=0.1, fused=fused)


def test_the_bf16_weights_fused_master_step_accepts_the_sgd_subclass() -> None:
    from lit_amp_det.precision import fused_master_step

    param = torch.nn.Parameter(torch.randn(2, 2))
    reason = fused_master_step.unfused_reason(build_optimizer({**CONFIGS["sgd-nesterov"], "fused": "auto"}, [param]))
    assert reason is None or "not built" in reason
    assert fused_master_step.unfused_reason(optim.AdamW([param])) == "AdamW is not torch.optim.SGD"


@pytest.mark.parametrize("name", ["sgd-nesterov", "adam-amsgrad"])
def test_unfused_memory_order_classes_step_as_torchs(name: str) -> None:
    """Built by hand without ``fused``, the classes run torch's own (foreach) step, with the closure first."""
    config = CONFIGS[name]
    kwargs = {k: v for k, v in config.items() if k != "_target_"}
    torch_class = torch.optim.__dict__[config["_target_"].rpartition(".")[2]]
    results = []
    for cls in (optim.memory_order.MEMORY_ORDER_STEPS[torch_class], torch_class):
        params = _params()
        optimizer = cls(params, **kwargs)
        for step in range(3):
            def closure(step: int = step) -> torch.Tensor:
                _set_grads(params, step)
                return torch.tensor(float(step))

            assert optimizer.step(closure).item() == step
        results.append([p.detach().clone() for p in params])
    for ours, torchs in zip(*results):
        assert torch.equal(ours, torchs)

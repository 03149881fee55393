"""The non-finite step guard: the check and the skip stay on the device, a skipped step changes nothing
(parameters and optimizer state, SGD with momentum and weight decay and AdamW, for-loop, foreach and fused),
the counts are read on the host only every ``skip_check_every_n_steps`` steps, and a training step makes no
host sync.
"""

from __future__ import annotations

import collections
import copy as copy_module
import math
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lit_amp_det.precision import NonFiniteStepGuard, build_precision_plugin
from lit_amp_det.precision.skip import DeviceSkippedStep, gradients, non_finite

#: the aten ops through which the host reads a tensor's value (``bool()``, ``.item()``, ``float()``,
#: ``torch.equal``)
_HOST_READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.item.default,
    torch.ops.aten.equal.default,
}


class _HostReads(TorchDispatchMode):
    """Counts the host reads of tensor values made under it, by op (CPU tensors dispatch them as CUDA ones
    do).
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------------------------ the check


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [None, math.inf, -math.inf, math.nan])
def test_non_finite_finds_inf_and_nan_and_leaves_the_values(dtype: torch.dtype, bad: float | None) -> None:
    tensors = [
        torch.randn(5, 3, dtype=dtype),
        torch.randn(7, dtype=torch.float32),
        torch.randn((), dtype=dtype),
    ]
    if bad is not None:
        tensors[0][2, 1] = bad
    before = [t.clone() for t in tensors]
    with _HostReads() as reads:
        found = non_finite(tensors)
    assert not reads.ops
    assert found.dtype == torch.bool and found.dim() == 0 and bool(found) is (bad is not None)
    for t, b in zip(tensors, before):
        torch.testing.assert_close(t, b, rtol=0, atol=0, equal_nan=True)


def test_non_finite_of_nothing_and_of_sparse_values() -> None:
    assert not bool(non_finite([]))
    sparse = torch.sparse_coo_tensor(
        torch.tensor([[0, 2]]), torch.tensor([1.0, math.nan]), (4,), check_invariants=True
    )
    assert bool(non_finite([torch.ones(3), sparse]))
    finite = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor([2.0]), (4,), check_invariants=True)
    assert not bool(non_finite([finite]))


# ------------------------------------------------------------------------------------------------ the skip

_OPTIMIZERS: dict[str, Callable[[list[Tensor]], torch.optim.Optimizer]] = {
    "sgd-for-loop": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2, foreach=False),
    "sgd-foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2, foreach=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-2, fused=True),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adamw-for-loop": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=False),
    "adamw-foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
}


def _params() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(4, 3, generator=gen)), nn.Parameter(torch.randn(3, generator=gen))]


def _set_grads(params: list[nn.Parameter], step: int, bad: float | None = None) -> None:
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, 0.1 * (step + 1)) + 0.01 * i
    if bad is not None:
        params[0].grad[1, 2] = bad


def _state(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, object]]:
    """The optimizer's state by parameter position (comparable across optimizers), copied; empty entries left
    out.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {
        i: {k: v.clone() if isinstance(v, Tensor) else v for k, v in optimizer.state[p].items()}
        for i, p in enumerate(params)
        if optimizer.state.get(p)
    }


def _own_reads(name: str, optimizer: torch.optim.Optimizer, step: int) -> int:
    """Host reads the optimizer makes itself in a step (AdamW without ``capturable``/``fused`` reads its step
    count, a CPU tensor even when the parameters are on a GPU), measured on a copy.
    """
    params = [nn.Parameter(p.detach().clone()) for group in optimizer.param_groups for p in group["params"]]
    copy = _OPTIMIZERS[name](params)
    copy.load_state_dict(copy_module.deepcopy(optimizer.state_dict()))
    _set_grads(params, step)
    with _HostReads() as reads:
        copy.step()
    return sum(reads.ops.values())


def _assert_same(a: object, b: object) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, Tensor):
        assert isinstance(b, Tensor) and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        assert a == b


def _assert_next_finite_step_as_unguarded(
    skipper: DeviceSkippedStep,
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
    expected: torch.optim.Optimizer,
    reference: list[nn.Parameter],
    step: int,
) -> None:
    """A finite step after a skipped one: the guarded optimizer ends where the unguarded one, which never saw
    the skipped step, does (parameters and state bit for bit).
    """
    _set_grads(params, step)
    skipper.step(optimizer, non_finite(gradients(optimizer)))
    _set_grads(reference, step)
    expected.step()
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0)
    _assert_same(_state(optimizer), _state(expected))


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_skipped_step_leaves_parameters_and_optimizer_state_exactly_as_they_were(
    name: str, bad: float
) -> None:
    """Two real steps (the optimizer has state), then a poisoned one: nothing moves, nothing is read on the
    host; the next finite step is the one the optimizer would have taken without the poisoned step.
    """
    params, reference = _params(), _params()
    optimizer, expected = _OPTIMIZERS[name](params), _OPTIMIZERS[name](reference)
    skipper = DeviceSkippedStep()
    for step in range(2):
        _set_grads(params, step)
        skipper.step(optimizer, non_finite(gradients(optimizer)))
        _set_grads(reference, step)
        expected.step()
    values, state = [p.detach().clone() for p in params], _state(optimizer)
    assert len(state) == len(params)
    own_reads = _own_reads(name, optimizer, 2)
    _set_grads(params, 2, bad)
    with _HostReads() as reads:
        skip = non_finite(gradients(optimizer))
        skipper.step(optimizer, skip)
    assert sum(reads.ops.values()) == own_reads, reads.ops  # none of the guard's
    assert bool(skip)
    # a fused optimizer's kernel skips the step itself (found_inf, as under GradScaler): no copies are kept
    assert (len(skipper._buffers) == 0) == name.endswith("-fused")
    for p, v in zip(params, values):
        torch.testing.assert_close(p.detach(), v, rtol=0, atol=0)
    _assert_same(_state(optimizer), state)
    _assert_next_finite_step_as_unguarded(skipper, optimizer, params, expected, reference, 3)


@pytest.mark.parametrize("name", ["sgd-foreach", "adamw-foreach", "adamw-fused"])
def test_a_skipped_first_step_leaves_no_state_behind(name: str) -> None:
    """On a parameter's first step the optimizer creates its state: the host decides (one read) and removes
    it.
    """
    params, reference = _params(), _params()
    optimizer, expected = _OPTIMIZERS[name](params), _OPTIMIZERS[name](reference)
    skipper = DeviceSkippedStep()
    own_reads = _own_reads(name, optimizer, 0)
    _set_grads(params, 0, math.nan)
    with _HostReads() as reads:
        skipper.step(optimizer, non_finite(gradients(optimizer)))
    assert sum(reads.ops.values()) == own_reads + 1
    assert not _state(optimizer)
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0)
    _assert_next_finite_step_as_unguarded(skipper, optimizer, params, expected, reference, 1)


class _CountingSGD(torch.optim.SGD):
    """Keeps a Python int in its state (a value the device cannot select back)."""

    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["calls"] = self.state[p].get("calls", 0) + 1
        return super().step(closure)


def test_a_step_that_changes_python_state_is_decided_on_the_host() -> None:
    params = _params()
    optimizer = _CountingSGD(params, lr=0.1, momentum=0.9)
    skipper = DeviceSkippedStep()
    _set_grads(params, 0)
    skipper.step(optimizer, non_finite(gradients(optimizer)))
    values, state = [p.detach().clone() for p in params], _state(optimizer)
    _set_grads(params, 1, math.inf)
    skipper.step(optimizer, non_finite(gradients(optimizer)))
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    _assert_same(_state(optimizer), state)  # the count went back to 1 with the rest
    _set_grads(params, 1)
    skipper.step(optimizer, non_finite(gradients(optimizer)))
    assert {s["calls"] for s in optimizer.state.values()} == {2}


# ------------------------------------------------------------------------------------------------ the counts


def test_the_guard_counts_on_the_device_and_reads_every_n_steps() -> None:
    guard = NonFiniteStepGuard("bf16-mixed", max_consecutive=3, check_every_n_steps=4)
    reads = []
    read = guard._read
    guard._read = lambda: reads.append(1) or read()  # type: ignore[method-assign]
    with _HostReads() as host:
        for skipped in (True, True, False, True, True, False, False):  # runs of 2: under the limit
            guard.record(torch.tensor(skipped))
    assert not host.ops and len(reads) == 1  # after the 4th step only
    assert guard.skipped == 4 and guard.consecutive == 0
    assert guard.state_dict() == {"skipped": 4, "consecutive": 0}


def test_a_run_that_reached_the_limit_stops_at_the_next_read_even_after_it_ended() -> None:
    guard = NonFiniteStepGuard("32-true", max_consecutive=2, check_every_n_steps=5)
    for skipped in (False, True, True, False):
        guard.record(torch.tensor(skipped))
    with pytest.raises(
        RuntimeError,
        match=r"^2 consecutive.*trainer\.precision=32-true.*precision\.max_consecutive_skips=2.*"
        r"gradient_clip_val",
    ):
        guard.record(torch.tensor(False))


def test_the_guard_state_round_trips_and_the_settings_are_checked() -> None:
    guard = NonFiniteStepGuard("bf16-mixed", max_consecutive=5, check_every_n_steps=100)
    guard.load_state_dict({"skipped": 7, "consecutive": 2})
    guard.record(torch.tensor(True))
    assert guard.state_dict() == {"skipped": 8, "consecutive": 3}
    guard.load_state_dict({})  # the state of a checkpoint saved before the guard existed
    assert guard.state_dict() == {"skipped": 0, "consecutive": 0}
    with pytest.raises(ValueError, match=r"precision\.max_consecutive_skips.*\b0\b"):
        NonFiniteStepGuard("32-true", max_consecutive=0)
    with pytest.raises(ValueError, match=r"precision\.skip_check_every_n_steps.*\b0\b"):
        NonFiniteStepGuard("32-true", check_every_n_steps=0)


# ------------------------------------------------------------------------------------------------ in a fit


class _Tiny(pl.LightningModule):
    """A two-layer regression, SGD with momentum and weight decay; gradients of chosen steps are poisoned."""

    def __init__(self, poison_steps: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.poison_steps = poison_steps

    def training_step(self, batch, batch_idx):
        x = torch.linspace(-1, 1, 32).reshape(8, 4)
        return (self.net(x).float() - x.sum(1, keepdim=True)).pow(2).mean()

    def on_after_backward(self) -> None:
        if self.global_step in self.poison_steps:
            self.net[0].weight.grad[0, 0] = math.nan

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)

    def train_dataloader(self):
        return [0] * 16


def _fit_counting(precision: str, steps: int, check_every: int, poison_steps: set[int] = frozenset()):
    plugin = build_precision_plugin(precision, "cpu", skip_check_every_n_steps=check_every)
    per_step: list[collections.Counter[str]] = []
    optimizer_step = plugin.optimizer_step

    def counted(*args, **kwargs):
        with _HostReads() as reads:
            result = optimizer_step(*args, **kwargs)
        per_step.append(reads.ops)
        return result

    plugin.optimizer_step = counted  # type: ignore[method-assign]
    trainer = pl.Trainer(
        max_steps=steps,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        log_every_n_steps=1,
    )
    module = _Tiny(poison_steps)
    trainer.fit(module)
    return plugin, per_step


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-weights"])
def test_a_training_step_reads_nothing_on_the_host(precision: str) -> None:
    """Inside the plugin's ``optimizer_step`` (forward, backward, hooks, check, step, logging): no host read
    of a tensor, except once on the first step, where SGD creates its momentum buffers and the host decides
    whether to keep them. The step that skips (the 5th) reads nothing either.
    """
    plugin, per_step = _fit_counting(precision, steps=8, check_every=3, poison_steps={4})
    assert len(per_step) == 8
    assert per_step[0] == {"aten._local_scalar_dense.default": 1}
    assert [sum(c.values()) for c in per_step[1:]] == [0] * 7
    assert plugin.guard.skipped == 1 and plugin.guard.consecutive == 0


def test_the_plugin_reads_the_counts_every_n_steps_and_stops_a_diverged_run_then() -> None:
    plugin = build_precision_plugin("bf16-mixed", "cpu", max_consecutive_skips=3, skip_check_every_n_steps=5)
    reads = []
    read = plugin.guard._read
    plugin.guard._read = lambda: reads.append(1) or read()  # type: ignore[method-assign]
    trainer = pl.Trainer(
        max_steps=12,
        plugins=[plugin],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    module = _Tiny(poison_steps=set(range(100)))
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(RuntimeError, match=r"^5 consecutive.*max_consecutive_skips=3"):
        trainer.fit(module)
    assert (
        len(reads) == 1 and trainer.global_step == 4
    )  # the 5th step raised: 2 steps after the limit, at the read
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))  # no step changed anything

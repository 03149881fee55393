"""callbacks.cuda_graph: the whole training step replayed as one CUDA graph.

On the CPU everything up to the capture runs for real -- the data module feeding static buffers, manual
optimisation, the warm-up steps with their host-sync count, the lr as a device tensor filled by the schedule,
the step count, the guard -- with an eager stand-in for :func:`capture_graph` that runs the step again on the
same buffers and checks that each call replays the same ops on the same shapes (what a graph would hold). The
refusals are checked one by one. The optimizer made capturable and given back (in checkpoints too) is checked
on the CPU and, for a foreach AdamW whose capturable step keeps its counts on the device, on fake CUDA
tensors; the one side stream and the one memory pool with ``torch.cuda``'s stream and graph calls stubbed. The
capture itself runs under ``pytest -m cuda`` (``make gpu-check``).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.precision import MixedPrecision
from omegaconf import OmegaConf
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import SMOKE, compose_config
from lit_amp_det.app import tasks
from lit_amp_det.callbacks import cuda_graph
from lit_amp_det.callbacks.cuda_graph import (
    CUDAGraphTraining,
    capture_refusal,
    make_capturable,
    restore_configuration,
)
from lit_amp_det.module import MaskRCNNModule
from lit_amp_det.optim import build_optimizer

GRAPH = [
    "callbacks=[default,cuda_graph]",
    "speedups.sync_free.devices=[cpu,cuda]",
    "data.pad_instances=8",
    "+trainer.limit_val_batches=0",
    "trainer.precision=32-true",
    "callbacks.cuda_graph.warmup_steps=2",
]


class _OpTrace(TorchDispatchMode):
    """Every aten call that computes and its outputs' shapes, in order (``detach``, which autograd adds to
    what it saves as it sees fit and which launches nothing, is left out).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[tuple[int, ...], ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.detach.default:
            return out
        leaves = torch.utils._pytree.tree_leaves(out)
        self.calls.append((str(func), tuple(tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor))))
        return out


class _EagerCapture:
    """Stands in for :func:`capture_graph` on the CPU: each replay runs the step on the same static buffers,
    traced.
    """

    def __init__(self) -> None:
        self.captured = 0
        self.traces: list[list[Any]] = []

    def __call__(self, step, pool=None, stream=None):
        assert pool is None and stream is None  # a CPU step has neither
        self.captured += 1

        def replay():
            with _OpTrace() as trace:
                outputs = step()
            self.traces.append(trace.calls)
            return outputs

        return replay


@pytest.fixture
def on_cpu(monkeypatch: pytest.MonkeyPatch) -> _EagerCapture:
    capture = _EagerCapture()
    monkeypatch.setattr(CUDAGraphTraining, "device_types", ("cuda", "cpu"))
    monkeypatch.setattr(cuda_graph, "capture_graph", capture)
    return capture


def _fit(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    overrides: list[str],
    steps: int = 5,
    callbacks: tuple[pl.Callback, ...] = (),
) -> pl.Trainer:
    """A smoke fit of ``steps`` steps, ``callbacks`` added to the configured ones; returns its Trainer."""
    built: list[pl.Trainer] = []
    build_trainer = tasks.build_trainer

    def keep(cfg):
        built.append(build_trainer(cfg))
        built[-1].callbacks.extend(callbacks)
        return built[-1]

    monkeypatch.setattr(tasks, "build_trainer", keep)
    tasks.train(compose_config([*SMOKE, f"trainer.max_steps={steps}", "seed=3", *overrides], tmp_path))
    return built[0]


@pytest.mark.parametrize(
    "precision",
    [[], ["trainer.precision=bf16-mixed"], ["trainer.precision=16-mixed", "precision.fp16_on_cpu=true"]],
    ids=["32-true", "bf16-mixed", "16-mixed"],
)
def test_a_captured_step_trains_as_the_automatic_step_does(tmp_path, monkeypatch, on_cpu, precision) -> None:
    """Same seed, same batches: two warm-up steps, the capture, three replays train the weights the Lightning
    loop trains without the callback (autocast, GradScaler and the non-finite guard included); the step count,
    the schedule and the logged losses follow; replays repeat the same ops on the same shapes (nothing
    allocated by data).
    """
    graph = _fit(tmp_path / "graph", monkeypatch, [*GRAPH, *precision])
    plain = _fit(
        tmp_path / "plain", monkeypatch, [*(g for g in GRAPH if not g.startswith("callbacks")), *precision]
    )
    assert on_cpu.captured == 1 and len(on_cpu.traces) == 3
    assert len(on_cpu.traces[0]) > 1000 and on_cpu.traces[0] == on_cpu.traces[1] == on_cpu.traces[2]
    assert graph.global_step == plain.global_step == 5
    lr_graph, lr_plain = (t.optimizers[0].param_groups[0]["lr"] for t in (graph, plain))
    assert isinstance(lr_graph, float) and lr_graph == pytest.approx(
        lr_plain, rel=1e-6
    )  # a float again after fit
    plugins = graph.precision_plugin, plain.precision_plugin
    assert plugins[0].guard.skipped == plugins[1].guard.skipped == 0
    if plugins[0].scaler is not None:  # scaler.update() ran in every replay
        assert int(plugins[0].scaler._growth_tracker) == int(plugins[1].scaler._growth_tracker) == 5
    if (
        not precision
    ):  # the captured lr is an fp32 tensor (fused kernels read it so), the loop's a double: last-bit
        # update differences, which the detector's discrete choices (proposals kept, samples) amplify in
        # bf16/fp16
        weights = graph.lightning_module.state_dict(), plain.lightning_module.state_dict()
        assert weights[0] and weights[0].keys() == weights[1].keys()  # the loop below compares every tensor
        for key, value in weights[0].items():
            torch.testing.assert_close(
                value, weights[1][key], rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}"
            )
    logged = graph.callback_metrics
    assert torch.isfinite(logged["train/loss"]) and "train/loss_mask" in logged
    module = graph.lightning_module
    assert module.captured_step is None and module.automatic_optimization  # handed back at teardown


def test_batches_are_copied_into_one_set_of_static_buffers(tmp_path, monkeypatch, on_cpu) -> None:
    """Every training batch reaches the step in the same static tensors, refilled in place."""
    seen: list[tuple[int, ...]] = []
    run = CUDAGraphTraining.run

    def recording(self, module, images, targets):
        out = run(self, module, images, targets)
        (entry,) = self._entries.values()
        seen.append((entry.images[0].data_ptr(), entry.targets[0]["masks"].data_ptr()))
        assert torch.equal(entry.images[0], images[0]) and torch.equal(
            entry.targets[0]["boxes"], targets[0]["boxes"]
        )
        return out

    monkeypatch.setattr(CUDAGraphTraining, "run", recording)
    _fit(tmp_path, monkeypatch, GRAPH, steps=4)
    assert len(seen) == 4 and len(set(seen)) == 1


def _with(trainer: pl.Trainer, callback: pl.Callback) -> pl.Trainer:
    trainer.callbacks.append(callback)
    return trainer


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["callbacks.cuda_graph.warmup_steps=2"], r"trainer\.accelerator=gpu"),
    ],
    ids=["cpu"],
)
def test_a_cpu_run_is_refused(tmp_path, monkeypatch, overrides, message) -> None:
    with pytest.raises(RuntimeError, match=message):
        _fit(tmp_path, monkeypatch, [*GRAPH, *overrides], steps=1)


class _ClipsBeforeStep(pl.Callback):
    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        pass


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["speedups.sync_free=null"], r"speedups\.sync_free\.devices=\[cuda\]"),
        (["data.pad_instances=null"], r"^callbacks\.cuda_graph: .*data\.pad_instances"),
        (["model.transform.min_size=[56,64]"], r"model\.transform\.min_size=\[56, 64\]"),
        (["trainer.precision=bf16-weights"], r"trainer\.precision=bf16-weights"),
        (
            ["optim=sgd", "optim.optimizer.fused=null"],
            r"torch\.optim\.sgd\.SGD.*optim\.optimizer\.fused",
        ),
        (
            ["trainer.precision=16-mixed", "precision.fp16_on_cpu=true", "optim.optimizer.fused=null"],
            r"trainer\.precision=16-mixed.*AdamW.*optim\.optimizer\.fused",
        ),
        (["+trainer.gradient_clip_val=1.0"], r"trainer\.gradient_clip_val"),
        (["trainer.accumulate_grad_batches=2"], r"trainer\.accumulate_grad_batches"),
    ],
    ids=[
        "dynamic-model",
        "unpadded",
        "multi-scale",
        "master-weights",
        "foreach-sgd",
        "scaled-foreach",
        "clipping",
        "accumulation",
    ],
)
def test_what_a_graph_cannot_hold_is_refused_with_what_to_change(
    tmp_path, monkeypatch, on_cpu, overrides, message
) -> None:
    with pytest.raises(RuntimeError, match=message):
        _fit(tmp_path, monkeypatch, [*GRAPH, *overrides], steps=1)


class _OwnStep(MaskRCNNModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx)


def _smoke_module(tmp_path: Path, cls: type[MaskRCNNModule]) -> MaskRCNNModule:
    """The smoke model's module, built as ``cls`` (a MaskRCNNModule subclass)."""
    cfg = OmegaConf.to_container(compose_config(SMOKE, tmp_path).model, resolve=True)
    return cls(4, **{k: v for k, v in cfg.items() if not k.startswith("_") and k != "num_classes"})


@pytest.mark.parametrize("module", ["boring", "own-step"])
def test_a_module_whose_training_step_is_not_maskrcnn_modules_is_refused(tmp_path, on_cpu, module) -> None:
    """The captured step replaces what MaskRCNNModule.training_step runs: another module class, or a subclass
    with a training_step of its own, would silently train without its own step.
    """
    pl_module = BoringModel() if module == "boring" else _smoke_module(tmp_path, _OwnStep)
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    expected = (
        r"BoringModel.*MaskRCNNModule" if module == "boring" else r"_OwnStep.*MaskRCNNModule\.training_step"
    )
    with pytest.raises(RuntimeError, match=expected):
        CUDAGraphTraining().on_fit_start(trainer, pl_module)
    assert pl_module.automatic_optimization
    if isinstance(pl_module, MaskRCNNModule):
        assert pl_module.captured_step is None


def test_a_precision_plugin_the_user_passed_is_refused(tmp_path, monkeypatch, on_cpu) -> None:
    """Lightning's own plugin has no non-finite guard for the captured step to drive."""
    monkeypatch.setattr(
        tasks, "build_precision_plugin", lambda *args, **kwargs: MixedPrecision("bf16-mixed", "cpu")
    )
    with pytest.raises(RuntimeError, match=r"MixedPrecision.*trainer\.precision"):
        _fit(tmp_path, monkeypatch, GRAPH, steps=1)


def test_a_hook_inside_the_step_is_refused(tmp_path, monkeypatch, on_cpu) -> None:
    original = tasks.build_trainer
    monkeypatch.setattr(tasks, "build_trainer", lambda cfg: _with(original(cfg), _ClipsBeforeStep()))
    with pytest.raises(RuntimeError, match=r"_ClipsBeforeStep\.on_before_optimizer_step"):
        tasks.train(compose_config([*SMOKE, "trainer.max_steps=1", *GRAPH], tmp_path))


def test_a_host_sync_in_the_step_is_refused_naming_its_line(tmp_path, monkeypatch, on_cpu) -> None:
    from lit_amp_det.module import MaskRCNNModule

    def reads_the_loss(self, loss_dict):
        total = sum(loss_dict.values())
        assert float(total.detach()) > -1  # a host read of a device value
        return total

    monkeypatch.setattr(MaskRCNNModule, "compute_loss", reads_the_loss)
    with pytest.raises(RuntimeError, match=r"(?s)\b1 time.*test_cuda_graph\.py:\d+"):
        _fit(tmp_path, monkeypatch, GRAPH, steps=2)


def test_a_new_batch_signature_beyond_max_graphs_is_refused() -> None:
    callback = CUDAGraphTraining(max_graphs=1)
    target = {"boxes": torch.zeros(4, 4), "valid": torch.zeros(4, dtype=torch.bool)}
    images, _ = callback.feed([torch.zeros(3, 32, 32)], [target], torch.device("cpu"))
    again, _ = callback.feed([torch.ones(3, 32, 32)], [target], torch.device("cpu"))
    assert again[0] is images[0] and bool(images[0].eq(1).all())  # refilled in place
    with pytest.raises(RuntimeError, match=r"\[\(3, 32, 48\)\].*max_graphs=1"):
        callback.feed([torch.zeros(3, 32, 48)], [target], torch.device("cpu"))


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"\bwarmup_steps=1\b"):
        CUDAGraphTraining(warmup_steps=1)
    with pytest.raises(ValueError, match=r"\bmax_graphs=0\b"):
        CUDAGraphTraining(max_graphs=0)


class _Snapshots(pl.Callback):
    """The weights at the start of training, and each step's logged loss."""

    def __init__(self) -> None:
        self.start: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []

    def on_train_start(self, trainer, module) -> None:
        self.start = {k: v.detach().clone() for k, v in module.state_dict().items()}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_captured_step_replays_on_a_gpu(tmp_path, monkeypatch) -> None:
    """A real capture (fp32, 2 eager steps, then 6 replays): every replay trains on its own batch (the losses
    differ), and the weights end where the automatic loop's end, up to a small part of how far both moved (GPU
    atomics make neither run bit-reproducible).
    """
    cuda = ["trainer=gpu", "trainer.devices=1"]
    snapshots: list[_Snapshots] = []
    original = tasks.build_trainer

    def recording(cfg):
        snapshots.append(_Snapshots())
        return _with(original(cfg), snapshots[-1])

    monkeypatch.setattr(tasks, "build_trainer", recording)
    seen = _OptimizerSeen()
    graph = _fit(tmp_path / "graph", monkeypatch, [*GRAPH, *cuda], steps=8, callbacks=(seen,))
    monkeypatch.setattr(tasks, "build_trainer", recording)
    automatic = [*(g for g in GRAPH if not g.startswith("callbacks")), *cuda]
    plain = _fit(tmp_path / "plain", monkeypatch, automatic, steps=8)
    assert graph.global_step == plain.global_step == 8
    # the default fused AdamW, made capturable (Adam's step refuses capture otherwise), steps on the device
    assert len(seen.seen) == 8 and all(step["capturable"] == [True] for step in seen.seen)
    assert all(step["lr"] == [torch.Tensor] and step["steps"] == {"cuda:0"} for step in seen.seen)
    assert type(graph.optimizers[0].param_groups[0]["lr"]) is float
    assert len(set(snapshots[0].losses[2:])) == 6 and all(map(math.isfinite, snapshots[0].losses))
    ours, theirs = graph.lightning_module.state_dict(), plain.lightning_module.state_dict()
    start = snapshots[1].start
    moved = sum(float((theirs[k].double() - start[k].double()).norm() ** 2) for k in start) ** 0.5
    apart = sum(float((ours[k].double() - theirs[k].double()).norm() ** 2) for k in start) ** 0.5
    assert moved > 0 and apart < 0.1 * moved, (apart, moved)


class _OptimizerSeen(pl.Callback):
    """The optimizer as each training step left it: its capturable flags, fused flags, lr types and step
    devices.
    """

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        optimizer = trainer.optimizers[0]
        self.seen.append(
            {
                "default": optimizer.defaults["capturable"],
                "capturable": [group["capturable"] for group in optimizer.param_groups],
                "fused": [group["fused"] for group in optimizer.param_groups],
                "lr": [type(group["lr"]) for group in optimizer.param_groups],
                "steps": {str(state["step"].device) for state in optimizer.state.values()},
            }
        )


def test_the_default_adamw_is_made_capturable_for_the_run_and_given_back(
    tmp_path, monkeypatch, on_cpu
) -> None:
    """conf/optim/adamw.yaml builds a fused AdamW that is not capturable (Adam's step refuses capture then):
    the callback sets the flag before the first step, every step runs capturable with a device lr, and the fit
    ends with the optimizer as it was built.
    """
    seen = _OptimizerSeen()
    trainer = _fit(tmp_path, monkeypatch, GRAPH, steps=3, callbacks=(seen,))
    assert len(seen.seen) == 3
    for step in seen.seen:
        assert step["default"] is True and step["capturable"] == [True] and step["fused"] == [True]
        assert step["lr"] == [torch.Tensor] and step["steps"] == {"cpu"}
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["capturable"] is False and optimizer.param_groups[0]["capturable"] is False
    assert type(optimizer.param_groups[0]["lr"]) is float


def _foreach_adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW from conf/optim/adamw.yaml as the module builds it, with PyTorch's default implementation
    (foreach).
    """
    config = compose_config([*SMOKE, "optim.optimizer.fused=null"]).optim.optimizer
    return build_optimizer(dict(config), params)


def test_a_foreach_adamw_steps_capturably_on_fake_cuda_tensors() -> None:
    """On fake CUDA tensors (no GPU; a host read of a device value raises there): a foreach AdamW's step
    counts, kept on the CPU as its uncapturable steps keep them, move to the device; its step then runs with a
    device lr and no host read, where its uncapturable step read the count on the host; restoring gives back
    the flag and the CPU counts.
    """
    with FakeTensorMode():
        param = torch.nn.Parameter(torch.zeros(4, 3, device="cuda"))
        optimizer = _foreach_adamw([param])
        # what an uncapturable step leaves (torch.optim.Adam._init_group): the count on the CPU
        optimizer.state[param] = {
            "step": torch.tensor(3.0),
            "exp_avg": torch.zeros_like(param),
            "exp_avg_sq": torch.zeros_like(param),
        }
        param.grad = torch.ones_like(param)
        optimizer.param_groups[0]["lr"] = torch.tensor(1e-3, device="cuda")
        with pytest.raises(DataDependentOutputException):  # the uncapturable step reads its count on the host
            optimizer.step()
        assert capture_refusal(optimizer) is None
        flags = make_capturable(optimizer)
        assert flags.default is False and flags.groups == (False,)
        assert optimizer.defaults["capturable"] is True and optimizer.param_groups[0]["capturable"] is True
        assert optimizer.state[param]["step"].device.type == "cuda"
        optimizer.step()
        optimizer.param_groups[0]["lr"] = (
            1e-3  # a fake tensor has no value to read back (the CPU fit checks that)
        )
        restore_configuration(optimizer, flags)
        assert optimizer.defaults["capturable"] is False and optimizer.param_groups[0]["capturable"] is False
        assert optimizer.state[param]["step"].device.type == "cpu"
        assert type(optimizer.param_groups[0]["lr"]) is float


def test_what_cannot_be_made_capturable_is_named_with_what_to_change() -> None:
    """SGD has no capturable mode: fused, its kernel reads a device lr; foreach or for-loop, it reads it on
    the host.
    """
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert capture_refusal(torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)) is None
    assert capture_refusal(torch.optim.AdamW(params, lr=0.1, foreach=False)) is None
    for foreach in (True, False):
        refusal = capture_refusal(torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=foreach))
        assert refusal is not None
        assert refusal.startswith("torch.optim.sgd.SGD has no capturable mode in torch ")
        assert "build it fused (optim.optimizer.fused=auto, the default, or true)" in refusal


def test_a_checkpoint_saved_while_capturing_resumes_into_a_foreach_adamw() -> None:
    """A foreach AdamW made capturable with a device lr, as the callback runs it: its checkpoint holds the
    optimizer as built, so a new foreach AdamW (on the CPU, where capturable cannot run) loads it and steps.
    Without the callback's rewrite, the saved lr tensor and capturable flag follow the state into the new
    optimizer.
    """
    params = [torch.nn.Parameter(torch.ones(4, 3))]
    optimizer = _foreach_adamw(params)
    params[0].grad = torch.full_like(params[0], 0.5)
    optimizer.step()  # the state exists, its count on the CPU
    callback = CUDAGraphTraining()
    callback._flags = make_capturable(optimizer)
    optimizer.param_groups[0]["lr"] = torch.tensor(2e-3)  # what on_train_start sets, on the root device
    raw = {
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [{"_last_lr": [torch.tensor(2e-3)]}],
    }
    checkpoint = {**raw}
    callback.on_save_checkpoint(None, None, checkpoint)
    saved = checkpoint["optimizer_states"][0]
    assert type(saved["param_groups"][0]["lr"]) is float and saved["param_groups"][0]["capturable"] is False
    assert type(checkpoint["lr_schedulers"][0]["_last_lr"][0]) is float
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)  # the running optimizer is left alone
    assert raw["optimizer_states"][0]["param_groups"][0]["capturable"] is True
    for state, works in ((saved, True), (raw["optimizer_states"][0], False)):
        resumed_params = [torch.nn.Parameter(torch.ones(4, 3))]
        resumed = _foreach_adamw(resumed_params)
        resumed.load_state_dict(state)
        resumed_params[0].grad = torch.full_like(resumed_params[0], 0.5)
        if works:
            resumed.step()
            assert int(resumed.state[resumed_params[0]]["step"]) == 2
        else:
            with pytest.raises(
                AssertionError, match="capturable=True, params and state_steps must be on supported"
            ):
                resumed.step()


class _StepsSeen(pl.Callback):
    """``trainer.global_step`` as each training batch starts."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.steps.append(trainer.global_step)


def test_a_run_that_captured_resumes_from_its_last_checkpoint_without_the_callback(
    tmp_path, monkeypatch, on_cpu
) -> None:
    """The whole path: a CPU fit with the callback writes last.ckpt with float lrs, the flags as built and the
    step count of automatic optimisation, and a fit without the callback, configured with a foreach AdamW
    (``load_state_dict`` then takes the saved group's ``fused``), resumes from it at that step and trains on.
    """
    _fit(tmp_path / "graph", monkeypatch, GRAPH, steps=3)
    path = tmp_path / "graph" / "checkpoints" / "last.ckpt"
    saved = torch.load(path, map_location="cpu", weights_only=False)
    (group,) = saved["optimizer_states"][0]["param_groups"]
    assert type(group["lr"]) is float and group["capturable"] is False
    assert type(saved["lr_schedulers"][0]["_last_lr"][0]) is float
    plain = [g for g in GRAPH if not g.startswith("callbacks")]
    first = _StepsSeen()
    overrides = [*plain, "optim.optimizer.fused=null", f"ckpt_path={path}"]
    resumed = _fit(tmp_path / "resumed", monkeypatch, overrides, callbacks=(first,))
    assert first.steps[0] == 3 and resumed.global_step > 3
    assert type(resumed.optimizers[0].param_groups[0]["lr"]) is float


class _Stream:
    """Stands in for ``torch.cuda.Stream``: counts how many are made and which streams each waits for."""

    made = 0

    def __init__(self, device=None) -> None:
        type(self).made += 1
        self.waited: list[Any] = []

    def wait_stream(self, other) -> None:
        self.waited.append(other)


def test_warm_up_steps_and_captures_run_on_one_side_stream_and_share_one_pool(monkeypatch) -> None:
    """With ``torch.cuda``'s stream and graph calls stubbed (no GPU here): three warm-up steps and two
    captures on a CUDA device make one side stream and one pool handle, and every capture gets both.
    """
    main = _Stream()
    _Stream.made = 0
    entered: list[Any] = []
    graphs: list[dict[str, Any]] = []
    handles: list[tuple[int, int]] = []

    @contextlib.contextmanager
    def stream(side):
        entered.append(side)
        yield

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None):
        graphs.append({"pool": pool, "stream": stream})
        yield

    def graph_pool_handle():
        handles.append((0, len(handles) + 1))
        return handles[-1]

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", graph_pool_handle)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    callback = CUDAGraphTraining()
    cuda = torch.device("cuda", 0)
    outputs = ({"loss_mask": torch.ones(())}, torch.ones(()))
    for _ in range(3):
        assert callback._eager(lambda: outputs, cuda, count_syncs=False) is outputs
    for _ in range(2):
        callback._capture(lambda: outputs, cuda)
    assert _Stream.made == 1 and len(handles) == 1
    (side,) = set(entered)
    assert len(entered) == 3 and side.waited == [main] * 3 and main.waited == [side] * 3
    assert graphs == [{"pool": handles[0], "stream": side}] * 2


def test_the_counted_warm_up_step_runs_with_cuda_syncs_raising(monkeypatch) -> None:
    """On CUDA, the pre-capture step also runs under ``torch.cuda.set_sync_debug_mode("error")`` (the driver's
    check of what the count cannot see), and the mode is put back, even when the step fails.
    """
    from lit_amp_det.callbacks import cuda_graph

    modes = [0]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: modes.append(mode))
    with cuda_graph._syncs_raise(torch.device("cuda")):
        assert modes[-1] == "error"
    assert modes == [0, "error", 0]
    with pytest.raises(RuntimeError), cuda_graph._syncs_raise(torch.device("cuda")):
        raise RuntimeError("called a synchronizing CUDA operation")
    assert modes[-1] == 0
    with cuda_graph._syncs_raise(torch.device("cpu")):
        assert modes[-1] == 0  # nothing to check on a CPU
    assert cuda_graph._is_sync_error(RuntimeError("called a synchronizing CUDA operation"))
    assert not cuda_graph._is_sync_error(RuntimeError("out of memory"))

"""callbacks.cuda_graph: the whole training step replayed as one CUDA graph.

On the CPU everything up to the capture runs for real -- the data module feeding static buffers, manual optimisation,
the warm-up steps with their host-sync count, the lr as a device tensor filled by the schedule, the step count, the
guard -- with an eager stand-in for :func:`capture_graph` that runs the step again on the same buffers and checks that
each call replays the same ops on the same shapes (what a graph would hold). The refusals are checked one by one. The
capture itself runs under ``pytest -m cuda`` (``make gpu-check``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import SMOKE, compose_config
from torch.utils._python_dispatch import TorchDispatchMode

from lit_amp_det.app import tasks
from lit_amp_det.callbacks import cuda_graph
from lit_amp_det.callbacks.cuda_graph import CUDAGraphTraining

GRAPH = ["callbacks=[default,cuda_graph]", "speedups.sync_free.devices=[cpu,cuda]", "data.pad_instances=8",
         "+trainer.limit_val_batches=0", "trainer.precision=32-true", "callbacks.cuda_graph.warmup_steps=2"]


class _OpTrace(TorchDispatchMode):
    """Every aten call that computes and its outputs' shapes, in order (``detach``, which autograd adds to what it
    saves as it sees fit and which launches nothing, is left out)."""

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
    """Stands in for :func:`capture_graph` on the CPU: each replay runs the step on the same static buffers, traced."""

    def __init__(self) -> None:
        self.captured = 0
        self.traces: list[list[Any]] = []

    def __call__(self, step):
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


def _fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str], steps: int = 5) -> pl.Trainer:
    """A smoke fit of ``steps`` steps; returns its Trainer."""
    built: list[pl.Trainer] = []
    build_trainer = tasks.build_trainer

    def keep(cfg):
        built.append(build_trainer(cfg))
        return built[-1]

    monkeypatch.setattr(tasks, "build_trainer", keep)
    tasks.train(compose_config([*SMOKE, f"trainer.max_steps={steps}", "seed=3", *overrides], tmp_path))
    return built[0]


@pytest.mark.parametrize("precision", [[], ["trainer.precision=bf16-mixed"],
                                       ["trainer.precision=16-mixed", "precision.fp16_on_cpu=true"]],
                         ids=["32-true", "bf16-mixed", "16-mixed"])
def test_a_captured_step_trains_as_the_automatic_step_does(tmp_path, monkeypatch, on_cpu, precision) -> None:
    """Same seed, same batches: two warm-up steps, the capture, three replays train the weights the Lightning loop
    trains without the callback (autocast, GradScaler and the non-finite guard included); the step count, the
    schedule and the logged losses follow; replays repeat the same ops on the same shapes (nothing allocated by
    data)."""
    graph = _fit(tmp_path / "graph", monkeypatch, [*GRAPH, *precision])
    plain = _fit(tmp_path / "plain", monkeypatch, [*(g for g in GRAPH if not g.startswith("callbacks")), *precision])
    assert on_cpu.captured == 1 and len(on_cpu.traces) == 3
    assert len(on_cpu.traces[0]) > 1000 and on_cpu.traces[0] == on_cpu.traces[1] == on_cpu.traces[2]
    assert graph.global_step == plain.global_step == 5
    lr_graph, lr_plain = (t.optimizers[0].param_groups[0]["lr"] for t in (graph, plain))
    assert isinstance(lr_graph, torch.Tensor) and float(lr_graph) == pytest.approx(lr_plain, rel=1e-6)
    plugins = graph.precision_plugin, plain.precision_plugin
    assert plugins[0].guard.skipped == plugins[1].guard.skipped == 0
    if getattr(plugins[0], "scaler", None) is not None:  # scaler.update() ran in every replay
        assert int(plugins[0].scaler._growth_tracker) == int(plugins[1].scaler._growth_tracker) == 5
    if not precision:  # the captured lr is an fp32 tensor (fused kernels read it so), the loop's a double: last-bit
        # update differences, which the detector's discrete choices (proposals kept, samples) amplify in bf16/fp16
        weights = graph.lightning_module.state_dict(), plain.lightning_module.state_dict()
        assert weights[0] and weights[0].keys() == weights[1].keys()  # the loop below compares every tensor
        for key, value in weights[0].items():
            torch.testing.assert_close(value, weights[1][key], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, key=key: f"{key}: {m}")
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
        assert torch.equal(entry.images[0], images[0]) and torch.equal(entry.targets[0]["boxes"], targets[0]["boxes"])
        return out

    monkeypatch.setattr(CUDAGraphTraining, "run", recording)
    _fit(tmp_path, monkeypatch, GRAPH, steps=4)
    assert len(seen) == 4 and len(set(seen)) == 1


def _with(trainer: pl.Trainer, callback: pl.Callback) -> pl.Trainer:
    trainer.callbacks.append(callback)
    return trainer


@pytest.mark.parametrize(("overrides", "message"), [
    (["callbacks.cuda_graph.warmup_steps=2"], "CUDA graphs need trainer.accelerator=gpu"),
], ids=["cpu"])
def test_a_cpu_run_is_refused(tmp_path, monkeypatch, overrides, message) -> None:
    with pytest.raises(RuntimeError, match=message):
        _fit(tmp_path, monkeypatch, [*GRAPH, *overrides], steps=1)


class _ClipsBeforeStep(pl.Callback):
    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        pass


@pytest.mark.parametrize(("overrides", "message"), [
    (["speedups.sync_free=null"], r"shapes change from step to step: apply speedups.sync_free"),
    (["data.pad_instances=null"], r"targets are not padded; set data.pad_instances"),
    (["model.transform.min_size=[56,64]"], r"draws a scale per batch"),
    (["trainer.precision=bf16-weights"], r"trainer.precision=bf16-weights; it captures 32-true"),
    (["optim.optimizer.fused=null"], r"reads its lr on the host each step: build it fused"),
    (["+trainer.gradient_clip_val=1.0"], r"gradient_clip_val .* are not captured"),
    (["trainer.accumulate_grad_batches=2"], r"accumulate_grad_batches are not captured"),
], ids=["dynamic-model", "unpadded", "multi-scale", "master-weights", "unfused", "clipping", "accumulation"])
def test_what_a_graph_cannot_hold_is_refused_with_what_to_change(tmp_path, monkeypatch, on_cpu, overrides,
                                                                 message) -> None:
    with pytest.raises(RuntimeError, match=message):
        _fit(tmp_path, monkeypatch, [*GRAPH, *overrides], steps=1)


def test_a_hook_inside_the_step_is_refused(tmp_path, monkeypatch, on_cpu) -> None:
    original = tasks.build_trainer
    monkeypatch.setattr(tasks, "build_trainer", lambda cfg: _with(original(cfg), _ClipsBeforeStep()))
    with pytest.raises(RuntimeError, match=r"_ClipsBeforeStep.on_before_optimizer_step would run once, at capture"):
        tasks.train(compose_config([*SMOKE, "trainer.max_steps=1", *GRAPH], tmp_path))


def test_a_host_sync_in_the_step_is_refused_naming_its_line(tmp_path, monkeypatch, on_cpu) -> None:
    from lit_amp_det.module import MaskRCNNModule

    def reads_the_loss(self, loss_dict):
        total = sum(loss_dict.values())
        assert float(total.detach()) > -1  # a host read of a device value
        return total

    monkeypatch.setattr(MaskRCNNModule, "compute_loss", reads_the_loss)
    with pytest.raises(RuntimeError, match=r"(?s)host wait for the device 1 time.*test_cuda_graph.py:\d+"):
        _fit(tmp_path, monkeypatch, GRAPH, steps=2)


def test_a_new_batch_signature_beyond_max_graphs_is_refused() -> None:
    callback = CUDAGraphTraining(max_graphs=1)
    target = {"boxes": torch.zeros(4, 4), "valid": torch.zeros(4, dtype=torch.bool)}
    images, _ = callback.feed([torch.zeros(3, 32, 32)], [target], torch.device("cpu"))
    again, _ = callback.feed([torch.ones(3, 32, 32)], [target], torch.device("cpu"))
    assert again[0] is images[0] and bool(images[0].eq(1).all())  # refilled in place
    with pytest.raises(RuntimeError, match=r"new shape signature \(images \[\(3, 32, 48\)\]\).*max_graphs=1"):
        callback.feed([torch.zeros(3, 32, 48)], [target], torch.device("cpu"))


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="warmup_steps=1 must be >= 2"):
        CUDAGraphTraining(warmup_steps=1)
    with pytest.raises(ValueError, match="max_graphs=0 must be >= 1"):
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
    """A real capture (fp32, 2 eager steps, then 6 replays): every replay trains on its own batch (the losses differ),
    and the weights end where the automatic loop's end, up to a small part of how far both moved (GPU atomics make
    neither run bit-reproducible)."""
    cuda = ["trainer=gpu", "trainer.devices=1"]
    snapshots: list[_Snapshots] = []
    original = tasks.build_trainer

    def recording(cfg):
        snapshots.append(_Snapshots())
        return _with(original(cfg), snapshots[-1])

    monkeypatch.setattr(tasks, "build_trainer", recording)
    graph = _fit(tmp_path / "graph", monkeypatch, [*GRAPH, *cuda], steps=8)
    monkeypatch.setattr(tasks, "build_trainer", recording)
    automatic = [*(g for g in GRAPH if not g.startswith("callbacks")), *cuda]
    plain = _fit(tmp_path / "plain", monkeypatch, automatic, steps=8)
    assert graph.global_step == plain.global_step == 8
    assert len(set(snapshots[0].losses[2:])) == 6 and all(map(math.isfinite, snapshots[0].losses))
    ours, theirs = graph.lightning_module.state_dict(), plain.lightning_module.state_dict()
    start = snapshots[1].start
    moved = sum(float((theirs[k].double() - start[k].double()).norm() ** 2) for k in start) ** 0.5
    apart = sum(float((ours[k].double() - theirs[k].double()).norm() ** 2) for k in start) ** 0.5
    assert moved > 0 and apart < 0.1 * moved, (apart, moved)

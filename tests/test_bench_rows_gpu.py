"""The training rows ``make gpu-check`` runs can run: built exactly as the bench builds them, their callbacks
take them.

A GPU check that stops at its step-graph row costs a lent GPU's minutes and measures nothing, so each quick
row is run here by ``bench train``'s own :func:`run_row` for CUDA (its overrides, the composed config, the
module, the padded batch, the callbacks, the Trainer with the precision plugin CUDA gets) up to where CUDA
would be needed, the first step: the Trainer runs on the CPU with that plugin, and Lightning calls every
callback's setup and fit-start checks, ``callbacks.cuda_graph`` told that a CPU stands for the GPU. Then the
step-graph row runs whole on the CPU through :func:`run_row` (tiny model), its capture stood in for by an
eager replay, its batch padded as the data module pads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lit_amp_det.bench import gpu_check, measure
from lit_amp_det.bench.measure import build_trainer, pad_training_targets, run_row, shapes_batch
from lit_amp_det.bench.rows import BENCHES, PAD_INSTANCES, Setting, compose, device_defaults, row_overrides
from lit_amp_det.callbacks import cuda_graph
from lit_amp_det.callbacks.cuda_graph import CUDAGraphTraining
from lit_amp_det.data.coco import pad_instances

TRAIN = BENCHES["train"]
NAMES = [row.name for row in TRAIN.rows]
QUICK_TRAIN = gpu_check.QUICK["train"][gpu_check.QUICK["train"].index("--rows") + 1].split(",")
#: the tiny CPU run of the step-graph row (as ``make gpu-check ARGS=--rehearse`` runs it)
TINY = Setting(
    device="cpu",
    model="maskrcnn_tiny",
    batch=2,
    height=64,
    width=64,
    num_classes=4,
    steps=1,
    warmup=3,
    compile_warmup=3,
    half="bf16",
)


def _gpu_check_setting(half: str) -> Setting:
    """The setting ``make gpu-check`` gives ``bench train`` on a GPU: the device's defaults and the quick
    options.
    """
    options = gpu_check.QUICK_OPTIONS
    defaults = device_defaults("cuda")
    return Setting(
        device="cuda",
        model=defaults["model"],
        batch=defaults["batch"],
        height=defaults["size"][0],
        width=defaults["size"][1],
        num_classes=81,
        steps=int(options[options.index("--steps") + 1]),
        warmup=int(options[options.index("--warmup") + 1]),
        compile_warmup=0,
        half=half,
    )


@pytest.fixture
def cpu_stands_for_cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``callbacks.cuda_graph`` accepts a CPU device, and each capture is an eager replay; returns the replay
    count.
    """
    replays: list[int] = []

    def capture(step: Any) -> Any:
        def replay() -> Any:
            replays.append(1)
            return step()

        return replay

    monkeypatch.setattr(CUDAGraphTraining, "device_types", ("cuda", "cpu"))
    monkeypatch.setattr(cuda_graph, "capture_graph", capture)
    return replays


def test_the_quick_rows_include_the_step_graph_row() -> None:
    """The rows below are the ones checked: the GPU check's step-graph row is among them."""
    assert "step-graph" in QUICK_TRAIN and set(QUICK_TRAIN) <= set(NAMES)


class _ReachedTheStep(Exception):
    """Raised where the first training step would start: on a GPU, where CUDA would be needed."""


class _StopBeforeTheStep(pl.Callback):
    """Last of the callbacks: records the run as built once every callback's ``on_fit_start`` took it, then
    stops.
    """

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen = {
            "precision": trainer.precision,
            "plugin_device": getattr(trainer.precision_plugin, "device", None),
            "speedups": pl_module.applied_speedups,
            "transforms": [t.name for t in pl_module.model_transforms() if t.applies_to("cuda")],
            "captured_step": getattr(pl_module, "captured_step", None),
            "callbacks": [type(c).__name__ for c in trainer.callbacks],
        }
        raise _ReachedTheStep


@pytest.mark.parametrize("half", ["fp16", "bf16"])
@pytest.mark.parametrize("row", QUICK_TRAIN)
def test_a_quick_train_row_built_for_cuda_passes_its_callbacks_checks(
    row: str,
    half: str,
    cpu_stands_for_cuda: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each quick row for CUDA, run by the bench's :func:`run_row` up to its first step: the Trainer with the
    precision plugin CUDA gets, on this CPU; every callback's setup and fit-start checks take it (today the
    step-graph row inherits half weights, which a CUDA graph refuses, and its targets are not padded).
    """
    stop = _StopBeforeTheStep()

    def build_on_this_cpu(cfg: Any, callbacks: Any, **options: Any) -> pl.Trainer:
        assert cfg.trainer.accelerator == "gpu"
        with monkeypatch.context() as cuda:  # the precision plugin CUDA gets
            cuda.setattr(torch.cuda, "is_available", lambda: True)
            return build_trainer(cfg, [*callbacks, stop], **options, accelerator="cpu")

    monkeypatch.setattr(measure, "build_trainer", build_on_this_cpu)
    setting = _gpu_check_setting(half)
    with pytest.raises(_ReachedTheStep):
        # at 224 px: eight rendered 800x1333 images cost seconds a case here, and the size changes no check
        run_row(TRAIN, NAMES.index(row), dataclasses.replace(setting, height=224, width=224))
    mixed = {"fp16": "16-mixed", "bf16": "bf16-mixed"}[half]
    assert stop.seen["precision"] == ("32-true" if row == "torchvision-fp32" else mixed)
    assert stop.seen["plugin_device"] in (None, "cuda"), "the fp32 plugin has no device"
    assert stop.seen["speedups"] == stop.seen["transforms"], "the speedups the GPU applies"
    graphs = stop.seen["callbacks"].count("CUDAGraphTraining")
    assert graphs == (1 if row == "step-graph" else 0)
    assert (stop.seen["captured_step"] is not None) == bool(graphs)


def test_the_bench_pads_a_training_batch_as_the_data_module_does() -> None:
    """The step-graph row's batch: every target padded by the data module's own function, a ``valid`` flag
    each.
    """
    cfg = compose(row_overrides(TRAIN, NAMES.index("step-graph"), TINY))
    assert f"data.pad_instances={cfg.data.pad_instances}" == PAD_INSTANCES
    _, targets = shapes_batch("val", range(2), 64, 64, 4)
    padded = pad_training_targets(cfg, targets)
    for given, target in zip(targets, padded, strict=True):
        expected = pad_instances(given, cfg.data.pad_instances)
        assert target.keys() == expected.keys() and int(target["valid"].sum()) == len(given["boxes"]) > 0
        assert all(torch.equal(target[key], expected[key]) for key in expected)
        assert target["boxes"].shape == (cfg.data.pad_instances, 4)
    first = compose(row_overrides(TRAIN, 0, TINY))
    assert first.data.pad_instances is None and pad_training_targets(first, targets) == targets


def test_the_step_graph_row_runs_on_the_cpu_as_the_bench_runs_it(cpu_stands_for_cuda: list[int]) -> None:
    """The bench's own row run: padded batches, the precision a graph holds, the capture after the warm-up
    steps, then replays for the timed and memory steps.
    """
    result = run_row(TRAIN, NAMES.index("step-graph"), TINY)
    assert result["precision"] == "bf16-mixed" and "sync_free" in result["speedups"]
    assert result["callbacks"] == ["FreezeNorm", "ConvBNEval", "CUDAGraphTraining"]
    assert len(cpu_stands_for_cuda) == TINY.steps + 1, "the timed step and the memory step are replays"
    assert result["host_syncs_per_step"] == 0 and len(result["step_ms_all"]) == TINY.steps


def test_a_cuda_row_above_adds_nothing_to_the_rows_below_it_on_a_cpu() -> None:
    """On a CPU the compile row below the step-graph row is the sync-free row plus compile (no CUDA-graph
    callback); on CUDA it keeps the step graph.
    """
    compile_row = NAMES.index("compile")
    on_cpu = row_overrides(TRAIN, compile_row, TINY)
    assert on_cpu == [*row_overrides(TRAIN, NAMES.index("sync-free"), TINY), *TRAIN.rows[compile_row].adds]
    cuda = dataclasses.replace(TINY, device="cuda")
    on_cuda = row_overrides(TRAIN, compile_row, cuda)
    assert on_cuda[:-1] == row_overrides(TRAIN, NAMES.index("step-graph"), cuda)
    assert "callbacks=[freeze_norm,conv_bn_eval,cuda_graph]" in on_cuda

"""MemoryMonitor: real per-step/epoch peaks, the savings table with baseline and bf16 rows, the baseline never
touching the model, optimizer, BatchNorm statistics or RNGs, conv-bn eval rows, and bad arguments.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader, Dataset, IterableDataset

from conftest import SMOKE, CaptureLogger, compose_config
from lit_amp_det.app.tasks import build_datamodule, build_model, build_trainer
from lit_amp_det.callbacks.memory_monitor import MemoryMonitor
from lit_amp_det.callbacks.memory_savings import draw_batches
from lit_amp_det.data.sampler import ResumableBatchSampler, ResumableDataLoader

#: Two steps per epoch, no validation, no checkpoints: only the monitor's behaviour is under test.
SHORT = [*SMOKE, "+trainer.limit_train_batches=2", "+trainer.limit_val_batches=0", "logger=none"]
RAM_MB = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20


class Snapshot(Callback):
    """Copies the detector's state, gradients, optimizer state, RNG state and the number of precision forward
    contexts entered so far, at the first training batch (``at_end``: when training ends).
    """

    def __init__(self, at_end: bool = False) -> None:
        self.at_end = at_end
        self.taken: dict[str, Any] | None = None

    def _take(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.taken = {
            "state": {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()},
            "grads": [p.grad is not None for p in pl_module.parameters()],
            "optimizer_state": len(trainer.optimizers[0].state),
            "rng": torch.get_rng_state(),
            "forward_contexts": getattr(trainer.precision_plugin, "contexts_entered", None),
        }

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.taken is None and not self.at_end:
            self._take(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_end:
            self._take(trainer, pl_module)


class CountForwardContexts(Callback):
    """Counts the precision plugin's forward contexts, to tell which comparison rows ran under autocast."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        plugin = trainer.precision_plugin
        plugin.contexts_entered = 0
        original = plugin.forward_context

        def counted() -> Any:
            plugin.contexts_entered += 1
            return original()

        plugin.forward_context = counted


def _fit(
    overrides: Sequence[str], tmp_path: Path, before: Sequence[Callback] = (), after: Sequence[Callback] = ()
) -> tuple[pl.Trainer, MemoryMonitor, CaptureLogger]:
    """A smoke fit in this process, with callbacks placed ``before`` and ``after`` the monitor."""
    cfg = compose_config([*SHORT, "callbacks=memory_monitor", *overrides], tmp_path)
    datamodule = build_datamodule(cfg)
    module = build_model(cfg, datamodule)
    trainer = build_trainer(cfg)
    logger = CaptureLogger()
    trainer.loggers = [logger]
    (monitor,) = [c for c in trainer.callbacks if isinstance(c, MemoryMonitor)]
    index = trainer.callbacks.index(monitor)
    trainer.callbacks[index : index + 1] = [*before, monitor, *after]
    trainer.fit(module, datamodule=datamodule)
    return trainer, monitor, logger


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    """One intra-op thread while these fits run: on a busy 2-core machine OpenMP threads waiting for each
    other make each step 10-50x slower. Behaviour, not speed, is tested here; the setting is restored
    afterwards.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_logs_real_peaks_every_step_and_epoch(tmp_path: Path) -> None:
    trainer, monitor, logger = _fit(["trainer.max_epochs=2", "trainer.precision=32-true"], tmp_path)
    assert trainer.global_step == 4 and not monitor.rows  # two epochs of two steps, no comparison asked for
    peaks = logger.values("memory/step_peak_mb")
    in_use = logger.values("memory/in_use_mb")
    assert len(peaks) == len(in_use) == 4
    for peak, used in zip(peaks, in_use):
        # a process holding torch, torchvision and a Mask R-CNN takes well over 100 MB and less than the RAM
        assert 100 < peak < RAM_MB and 100 < used <= peak + 1e-3, (peak, used)
    epoch_peaks = logger.values("memory/epoch_peak_mb")
    assert epoch_peaks == pytest.approx([max(peaks[:2]), max(peaks[2:])])
    assert not (tmp_path / "memory_savings.md").exists()


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> dict[str, Any]:
    """One bf16-mixed smoke fit (one epoch of two steps) with the baseline comparison, shared below."""
    out = tmp_path_factory.mktemp("bf16")
    before, after, end = Snapshot(), Snapshot(), Snapshot(at_end=True)
    overrides = [
        "trainer.max_epochs=1",
        "trainer.precision=bf16-mixed",
        "callbacks.memory_monitor.compare_baseline=true",
        "callbacks.memory_monitor.baseline_steps=1",
        "callbacks.memory_monitor.warmup_steps=1",
    ]
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setenv("LIT_AMP_DET_CACHE", str(cache_dir))
        trainer, monitor, logger = _fit(
            overrides, out, before=[CountForwardContexts(), before], after=[after, end]
        )
    return {
        "trainer": trainer,
        "monitor": monitor,
        "logger": logger,
        "out": out,
        "stdout": stdout.getvalue(),
        "before": before.taken,
        "after": after.taken,
        "end": end.taken,
    }


def test_bf16_savings_table_is_printed_written_and_logged(bf16_run: dict[str, Any]) -> None:
    out, stdout, logger = bf16_run["out"], bf16_run["stdout"], bf16_run["logger"]
    assert bf16_run["trainer"].global_step == 2
    assert "## Memory savings" in stdout and "| baseline: fp32, conv-bn eval off |" in stdout
    assert "| + bf16-mixed (this run) |" in stdout and "| training, observed over 2 steps |" in stdout
    table = (out / "memory_savings.md").read_text()
    assert table.strip() in stdout
    data = json.loads((out / "memory_savings.json").read_text())
    assert [row["label"] for row in data["rows"]] == ["baseline", "bf16-mixed"]
    assert data["precision"] == "bf16-mixed" and data["current"] == "bf16-mixed"
    assert data["rows"][0]["optimisations"] == [] and data["rows"][1]["optimisations"] == ["bf16-mixed"]
    for row in data["rows"]:
        assert 100 < row["peak_mb"] < RAM_MB and 0 <= row["step_mb"] < row["peak_mb"], row
        assert 0.5 < row["saved_for_backward_mb"] < 1000 and row["step_ms"] > 0, row
    base, bf16 = data["rows"]
    assert base["peak_vs_baseline"] == 1.0
    # fp32 keeps no weight copies; bf16 keeps a 2-byte copy of (at most) every trainable weight, and its
    # activations, the rest of what is saved, take less than the fp32 ones
    params = sum(
        p.numel() for p in bf16_run["trainer"].lightning_module.model.parameters() if p.requires_grad
    )
    assert base["weight_casts_mb"] == 0 and 0 < bf16["weight_casts_mb"] <= 2 * params / 2**20
    assert bf16["saved_for_backward_mb"] - bf16["weight_casts_mb"] < base["saved_for_backward_mb"]
    assert data["training"]["steps"] == 2 and 100 < data["training"]["peak_mb"] < RAM_MB

    logged = {key: value for _, metrics in logger.calls for key, value in metrics.items()}
    assert logged["memory/baseline_peak_mb"] == pytest.approx(base["peak_mb"])
    assert logged["memory/current_peak_mb"] == pytest.approx(bf16["peak_mb"])
    assert logged["memory/bf16_mixed_saved_for_backward_mb"] == pytest.approx(bf16["saved_for_backward_mb"])
    assert logged["memory/saved_for_backward_ratio"] == pytest.approx(
        bf16["saved_for_backward_mb"] / base["saved_for_backward_mb"], rel=1e-5
    )
    assert logged["memory/step_time_ratio"] == pytest.approx(bf16["step_ms"] / base["step_ms"], rel=1e-5)


def test_only_the_bf16_row_runs_under_the_precision_context(bf16_run: dict[str, Any]) -> None:
    # nothing before the first batch; then 1 warm-up + 1 measured step of the bf16 row, none for the baseline
    assert bf16_run["before"]["forward_contexts"] == 0
    assert bf16_run["after"]["forward_contexts"] == 2


def test_comparison_leaves_weights_bn_statistics_optimizer_and_rng_alone(bf16_run: dict[str, Any]) -> None:
    before, after, end = bf16_run["before"], bf16_run["after"], bf16_run["end"]
    assert [row.label for row in bf16_run["monitor"].rows] == ["baseline", "bf16-mixed"]
    assert any(key.endswith("running_mean") for key in before["state"])  # trainable BatchNorm is there
    assert _state_equal(before["state"], after["state"])
    assert not any(after["grads"]) and after["optimizer_state"] == 0
    assert torch.equal(before["rng"], after["rng"])
    # not vacuous: the two real training steps did change weights and BatchNorm running statistics
    changed = [k for k in end["state"] if not torch.equal(end["state"][k], before["state"][k])]
    assert any(k.endswith("running_mean") for k in changed) and any(k.endswith("weight") for k in changed)


def test_conv_bn_eval_row_measures_copies_and_keeps_it_on_the_model(tmp_path: Path) -> None:
    conv_bn = pytest.importorskip("lit_amp_det.models.conv_bn")
    from lit_amp_det.callbacks.conv_bn_eval import ConvBNEval
    from lit_amp_det.callbacks.freeze_norm import FreezeNorm

    overrides = [
        "trainer.max_epochs=1",
        "trainer.precision=32-true",
        "trainer.max_steps=1",
        "callbacks.memory_monitor.compare_baseline=true",
        "callbacks.memory_monitor.baseline_steps=1",
        "callbacks.memory_monitor.warmup_steps=0",
    ]
    seen: list[bool] = []

    class StillEnabled(Callback):
        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
        ) -> None:
            seen.append(conv_bn.conv_bn_eval_enabled(pl_module.model))

    _, monitor, _ = _fit(
        overrides, tmp_path, before=[FreezeNorm(mode="norm_eval"), ConvBNEval()], after=[StillEnabled()]
    )
    base, folded = monitor.rows
    assert (base.label, folded.label, folded.optimisations) == ("baseline", "conv-bn eval", ["conv-bn eval"])
    # folding keeps a weight-sized copy instead of each conv output: less is saved for backward
    assert folded.saved_for_backward_mb < base.saved_for_backward_mb
    assert "| + conv-bn eval (this run) |" in (tmp_path / "memory_savings.md").read_text()
    assert seen == [True]  # the baselines disabled it on their copies only


def test_half_weights_rows_measure_an_fp32_baseline_from_the_masters(tmp_path: Path) -> None:
    """``bf16-weights``: the baseline runs on a full-precision copy (the masters as weights), the bf16-weights
    row on a copy of the converted model; the real model's bf16 weights and masters are left as they were.
    """
    from lit_amp_det.precision.master_weights import master_weights_of

    overrides = [
        "trainer.max_epochs=1",
        "trainer.precision=bf16-weights",
        "trainer.max_steps=1",
        "callbacks.memory_monitor.compare_baseline=true",
        "callbacks.memory_monitor.baseline_steps=1",
        "callbacks.memory_monitor.warmup_steps=0",
    ]
    taken: list[dict[str, torch.Tensor]] = []

    class Parameters(Callback):  # the bf16 weights themselves (state_dict() holds the masters)
        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
        ) -> None:
            taken.append({n: p.detach().clone() for n, p in pl_module.model.named_parameters()})

    before, after = Snapshot(), Snapshot()
    with (
        pytest.warns(UserWarning, match="no native bf16")
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported()
        else contextlib.nullcontext()
    ):
        trainer, monitor, _ = _fit(
            overrides, tmp_path, before=[before, Parameters()], after=[after, Parameters()]
        )
    base, half = monitor.rows
    assert (base.label, half.label, half.optimisations) == ("baseline", "bf16-weights", ["bf16-weights"])
    # bf16 activations are half the fp32 baseline's; no autocast weight casts in either (the weights are bf16)
    assert half.saved_for_backward_mb < 0.7 * base.saved_for_backward_mb
    assert base.weight_casts_mb == half.weight_casts_mb == 0
    assert "| + bf16-weights (this run) |" in (tmp_path / "memory_savings.md").read_text()
    weights = master_weights_of(trainer.lightning_module)  # the plugin converts the LightningModule
    assert weights is not None and all(p.dtype == torch.bfloat16 for p in weights.params)
    # the comparison ran between the snapshots: the masters (state_dict), the bf16 weights, the gradients, the
    # optimizer and the RNG are as they were
    assert _state_equal(before.taken["state"], after.taken["state"]) and _state_equal(*taken)
    assert any(p.dtype == torch.bfloat16 for p in taken[0].values())
    assert not any(after.taken["grads"]) and after.taken["optimizer_state"] == 0
    assert torch.equal(before.taken["rng"], after.taken["rng"])


class _ByKey(Dataset):
    """A dataset indexed by the ``(index, seed)`` keys of :class:`ResumableBatchSampler`."""

    def __init__(self, samples: list[Any]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.samples[key[0]]


def _image_ids(batches: Sequence[Any]) -> list[list[int]]:
    return [[int(image[0, 0, 0]) for image in images] for images, _ in batches]


def test_batches_are_the_first_training_batches_and_the_loader_is_not_consumed() -> None:
    samples = [(torch.full((3, 4, 4), float(i)), {"labels": torch.tensor([1])}) for i in range(8)]
    sampler = ResumableBatchSampler(len(samples), 2, seed=3)
    loader = ResumableDataLoader(_ByKey(samples), sampler, collate_fn=lambda b: tuple(zip(*b)))
    loader.load_state_dict({"epoch": 0, "consumed_batches": 1})  # a resumed run: the first batch was consumed
    batches = draw_batches(loader, 2)
    assert batches is not None and len(batches) == 2
    training = list(loader)  # what training then gets: the resume position is still there
    assert len(training) == 3
    assert _image_ids(batches) == _image_ids(training[:2])


def test_streaming_loaders_fall_back_to_the_first_real_batch() -> None:
    class Stream(IterableDataset):
        def __iter__(self) -> Any:
            return iter([(torch.zeros(3, 4, 4), {})] * 4)

    stream = DataLoader(Stream(), batch_size=2, collate_fn=lambda b: tuple(zip(*b)))
    assert draw_batches(stream, 3) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"baseline_steps": 0}, r"^baseline_steps=0\b"),
        ({"warmup_steps": -1}, r"^warmup_steps=-1\b"),
        ({"compare_baseline": "yes"}, r"^compare_baseline='yes'"),
    ],
)
def test_bad_arguments_fail_in_the_constructor_naming_the_argument(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryMonitor(**kwargs)


def test_compare_baseline_needs_a_detector_module() -> None:
    trainer = SimpleNamespace(precision_plugin=SimpleNamespace(precision="32-true"))
    with pytest.raises(
        ValueError,
        match=r"`pl_module\.model`.*compare_baseline=false",
    ):
        MemoryMonitor(compare_baseline=True).setup(trainer, pl.LightningModule(), "fit")
    MemoryMonitor(compare_baseline=False).setup(
        trainer, pl.LightningModule(), "fit"
    )  # plain monitoring is fine

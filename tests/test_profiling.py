"""lit_amp_det.profiling: saved-tensor bytes (whole model and one module), the step timer's warm-up and clock,
the memory probe's baseline, image counting, and the bench's peak-memory step that measures through them.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lit_amp_det.profiling import HostSyncs, MemoryProbe, SavedTensorBytes, StepTimer, count_images, timed


def test_saved_tensor_bytes_counts_distinct_storages_and_skips_model_state() -> None:
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorBytes(exclude=[weight]) as counter:
        hidden = x @ weight  # saves x and weight: x counted, the parameter not
        out = (hidden.sin() * hidden.sin()).sum()  # saves hidden (once) and the two sin outputs
    out.backward()
    expected = x.nbytes + hidden.nbytes + 2 * hidden.nbytes
    assert counter.bytes == expected and counter.weight_cast_bytes == 0 and counter.within_bytes == 0

    with SavedTensorBytes(exclude=[weight]) as counter, torch.autocast("cpu", dtype=torch.bfloat16):
        out = (x @ weight).float().sum()  # saves bf16 copies of x and of the weight
    out.backward()
    assert counter.weight_cast_bytes == weight.numel() * 2  # the bf16 weight copy, recognised as one
    assert counter.bytes == x.numel() * 2 + weight.numel() * 2


def test_saved_tensor_bytes_attributes_storages_to_the_module_that_saved_them_first() -> None:
    first, second = nn.Linear(8, 16), nn.Linear(16, 4)
    model = nn.Sequential(first, nn.Sigmoid(), second)
    x = torch.randn(5, 8, requires_grad=True)
    with SavedTensorBytes(exclude=[*model.parameters()], within=first) as counter:
        out = model(x).sum()
    out.backward()
    # first saves x; the sigmoid saves its output, which second saves again (counted once, outside first)
    assert counter.within_bytes == x.nbytes
    assert counter.bytes == x.nbytes + 5 * 16 * 4
    assert not first._forward_hooks and not first._forward_pre_hooks  # the hooks are gone after the context


def test_step_timer_skips_warmup_steps_without_reading_the_clock() -> None:
    reads = iter([10.0, 10.25, 20.0, 20.5])
    timer = StepTimer("cpu", warmup=2, clock=lambda: next(reads))
    seconds = []
    for _ in range(4):
        timer.start()
        seconds.append(timer.stop())
    assert seconds == [None, None, 0.25, 0.5] and timer.steps_seen == 4
    assert next(reads, None) is None  # two reads per timed step, none for warm-up steps


def test_timed_measures_the_call() -> None:
    calls = []
    assert timed(lambda: calls.append(1), "cpu") >= 0 and calls == [1]


def test_cpu_probe_baseline_is_what_a_later_peak_is_measured_above() -> None:
    probe = MemoryProbe("cpu")
    assert probe.peak_reserved_bytes() is None
    probe.reset_peak()
    base = probe.baseline_bytes()
    assert 0 < base <= probe.peak_bytes()
    if probe.resettable:
        assert base == pytest.approx(probe.in_use_bytes(), rel=0.05)  # the resident set, not an old peak


def test_count_images_reads_detection_batches_and_names_the_fix_otherwise() -> None:
    assert count_images(([torch.zeros(3, 4, 4)] * 3, [{}] * 3)) == 3
    assert count_images((torch.zeros(5, 3, 4, 4), [{}] * 5)) == 5
    with pytest.raises(TypeError, match=r"training batch is a dict.*batch_size_fn"):
        count_images({"images": []})


def _timer_run(plan: list[str], step: Any) -> Any:
    """The bench's RowTimer driven as Lightning drives it on a CPU, ``step(batch_idx)`` between the hooks."""
    from lit_amp_det.bench.measure import RowTimer

    timer = RowTimer(plan)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    timer.on_train_start(trainer, None)
    for index in range(len(plan)):
        timer.on_train_batch_start(trainer, None, None, index)
        step(index)
        timer.on_train_batch_end(trainer, None, None, None, index)
    return timer


def test_bench_peak_step_counts_what_the_step_holds_not_the_heap_kept_before() -> None:
    """The bench's peak step: 96 MB allocated in small-ish blocks and freed (heap glibc may keep) before it,
    then a step that holds 64 MB more than an empty step reads 64 MB more.
    """
    if not MemoryProbe("cpu").resettable:
        pytest.skip("this kernel does not let the process reset its VmHWM")

    def holds(mb: int) -> Any:
        def step(index: int) -> None:
            if index == 0:
                blocks = [
                    torch.ones(2**20 // 4 * 3) for _ in range(32)
                ]  # 32 x 3 MB, below glibc's mmap threshold
                del blocks
            else:
                tensor = torch.ones(mb * 2**20 // 4)
                assert tensor.sum() == tensor.numel()  # every page written

        return step

    empty = _timer_run(["step", "memory"], holds(0))
    full = _timer_run(["step", "memory"], holds(64))
    assert 60 <= full.peak["peak_memory_mb"] - empty.peak["peak_memory_mb"] <= 70
    assert len(full.times["step"]) == 1 and "memory" not in full.times  # the peak step is not a timed one


def test_bench_peak_step_lifts_the_pinned_malloc_threshold_afterwards(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process that goes on working must not keep the 128 KB threshold (every larger allocation would fault
    in fresh pages): lifted after the peak step, and after a failed one; the timed steps run unpinned.
    """
    from lit_amp_det.bench import measure

    calls: list[str] = []
    monkeypatch.setattr(measure, "pin_malloc_threshold", lambda: calls.append("pin"))
    monkeypatch.setattr(measure, "unpin_malloc_threshold", lambda: calls.append("unpin"))
    timer = _timer_run(["warmup", "step", "memory"], lambda index: calls.append(f"step {index}"))
    assert calls == ["step 0", "step 1", "pin", "step 2", "unpin"] and list(timer.times) == ["warmup", "step"]
    calls.clear()
    timer.on_train_batch_start(None, None, None, 2)  # a memory step that raises: Lightning calls on_exception
    timer.on_exception(None, None, RuntimeError("step failed"))
    timer.on_exception(None, None, RuntimeError("again"))
    assert calls == ["pin", "unpin"]


# ------------------------------------------------------------------------------------- host synchronisations


def test_host_syncs_counts_what_waits_for_the_device_and_names_the_line() -> None:
    x = torch.randn(10)
    line = inspect.currentframe().f_lineno
    with HostSyncs() as syncs:
        x.sum().item()  # +2: a value read
        x[x > 0]  # +3: a boolean mask index (a nonzero inside the kernel)
        torch.where(x > 0)  # +4: one-argument where is nonzero
        x.repeat_interleave(torch.ones(10, dtype=torch.long))  # +5: output sized by the values
        y = x.clone()
        y[y > 0] = 0  # +7: boolean setitem
        torch.unique(x)  # +8
        bool(x.sum() > 0)  # +9
        # none of these waits: an integer index, a sized repeat, three-argument where, masked_fill, topk
        x[torch.tensor([1, 2])], x.repeat_interleave(torch.ones(10, dtype=torch.long), output_size=10)
        torch.where(x > 0, x, 0), x.masked_fill(x > 0, 0), x.topk(3)
    here = Path(__file__).resolve()
    assert {(op, site): n for (op, site), n in syncs.sites.items()} == {
        ("aten._local_scalar_dense", f"{here}:{line + 2}"): 1,
        ("aten.index", f"{here}:{line + 3}"): 1,
        ("aten.nonzero", f"{here}:{line + 4}"): 1,
        ("aten.repeat_interleave", f"{here}:{line + 5}"): 1,
        ("aten.index_put_", f"{here}:{line + 7}"): 1,
        ("aten._unique2", f"{here}:{line + 8}"): 1,
        ("aten._local_scalar_dense", f"{here}:{line + 9}"): 1,
    }
    assert syncs.total == 7 and f"{here}:{line + 2}" in syncs.table()


def test_host_syncs_counts_the_same_under_inference_mode() -> None:
    """Lightning predicts under ``torch.inference_mode``, where composite ops (``item``, one-argument
    ``where``, ``nonzero(as_tuple=True)``) reach the mode whole instead of as their value-reading parts.
    """
    with torch.inference_mode():
        x = torch.randn(10)
        with HostSyncs() as syncs:
            (
                x.sum().item(),
                x[x > 0],
                torch.where(x > 0),
                torch.nonzero(x > 0, as_tuple=True),
                bool(x.sum() > 0),
            )
            torch.where(x > 0, x, 0), x.masked_fill(x > 0, 0)
    assert syncs.total == 5, syncs.table()


def _fake_cuda() -> Any:
    """A fake tensor mode in which ``device="cuda"`` makes tensors without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def test_host_syncs_counts_copies_between_the_host_and_a_device() -> None:
    host = torch.ones(3)
    with _fake_cuda():
        device = torch.ones(3, device="cuda")
        line = inspect.currentframe().f_lineno
        with HostSyncs() as syncs:
            host.to("cuda")  # +2
            device.to("cpu")  # +3
            device.copy_(host)  # +4
            device.to("cuda"), device + 1, host.to("cpu")  # none: the same side
    here = Path(__file__).resolve()
    assert syncs.sites == {
        ("aten._to_copy cpu->cuda", f"{here}:{line + 2}"): 1,
        ("aten._to_copy cuda->cpu", f"{here}:{line + 3}"): 1,
        ("aten.copy_ cpu->cuda", f"{here}:{line + 4}"): 1,
    }
    assert syncs.kinds["device copy"] == 3 and syncs.total == 3


def test_host_syncs_counts_tensors_built_from_host_data_on_a_device() -> None:
    with _fake_cuda(), HostSyncs() as syncs:
        torch.tensor([1.0, 2.0], device="cuda")
        torch.as_tensor([0.5], device="cuda")
        torch.tensor([1.0, 2.0])  # on the host: no wait
        torch.full((2,), 0.5, device="cuda"), torch.zeros(2, device="cuda")  # filled on the device
    # one wait each (the copy that takes the numbers to the device is that wait, not a second one)
    assert syncs.kinds["host data on a device"] == 2 and syncs.total == 2, syncs.table()


def test_host_syncs_counts_host_reads_on_any_tensor_once() -> None:
    x = torch.arange(4.0)
    with HostSyncs() as syncs:
        x.tolist(), x.numpy(), x.cpu()
    assert syncs.kinds["host read"] == 3 and syncs.total == 3, syncs.table()
    with _fake_cuda():
        device = torch.ones(3, device="cuda")
        with HostSyncs() as syncs:
            device.cpu()  # one read: its copy is part of it
    assert syncs.sites.keys() == {("Tensor.cpu", syncs.table().split()[-1])} and syncs.total == 1, (
        syncs.table()
    )


def test_host_syncs_counts_ops_whose_cuda_kernels_read_back() -> None:
    x = torch.tensor([0, 1, 1, 3])
    with HostSyncs() as syncs:
        torch.bincount(x), torch.histc(x.float(), bins=4), torch.multinomial(x.float(), 2)
    assert syncs.kinds["read-back kernel"] == 3 and syncs.total == 3, syncs.table()


def test_host_syncs_counts_explicit_synchronisation_and_restores_it(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("device"))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: calls.append("stream"))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: calls.append("event"))
    patched = torch.cuda.synchronize
    with HostSyncs() as syncs:
        torch.cuda.synchronize()
        torch.cuda.Stream.synchronize(None)  # as a stream's method (no stream can be made without a GPU)
        torch.cuda.Event.synchronize(None)
    assert calls == ["device", "stream", "event"]
    assert syncs.kinds["explicit sync"] == 3 and syncs.total == 3, syncs.table()
    assert torch.cuda.synchronize is patched  # put back as it was


def test_lit_amp_det_adds_no_host_sync_to_a_training_step() -> None:
    """The tiny Mask R-CNN's training step on lit_amp_det's ops waits for the device where torchvision's code
    does and at two known points of ``models/ext_ops.py`` (the RPN's filters, the mask head's positives; issue
    42 removes them): a new one fails here, with the list of call sites.
    """
    from host_syncs import count, package_sites, tiny_model
    from lit_amp_det.models.speedups import ExtensionOps

    syncs = count(ExtensionOps()(tiny_model()), train=True)
    ours = package_sites(syncs)
    assert {site.rsplit(":", 1)[0] for site in ours} == {"models/ext_ops.py"}, syncs.table()
    assert len(ours) == 2 and sum(ours.values()) == 4 and syncs.total == 34, syncs.table()


class _CountSyncsPerStep(pl.Callback):
    """Host syncs from each training batch's start (after its transfer) to its end: forward, backward,
    optimizer and precision plugin, and the callbacks' per-step hooks.
    """

    def __init__(self) -> None:
        self.steps: list[HostSyncs] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.steps.append(HostSyncs())
        self.steps[-1].__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        self.steps[-1].__exit__(None, None, None)


def _fit_step_syncs(tmp_path: Path, monkeypatch, overrides: Sequence[str] = ()) -> list[HostSyncs]:
    """The host syncs of each of two smoke ``fit`` steps (default callbacks, the precision plugin)."""
    from conftest import SMOKE, compose_config
    from lit_amp_det.app import tasks

    counter, build_trainer = _CountSyncsPerStep(), tasks.build_trainer

    def with_counter(cfg):
        trainer = build_trainer(cfg)
        trainer.callbacks.insert(0, counter)
        return trainer

    monkeypatch.setattr(tasks, "build_trainer", with_counter)
    tasks.train(
        compose_config([*SMOKE, "trainer.max_steps=2", "+trainer.limit_val_batches=0", *overrides], tmp_path)
    )
    assert len(counter.steps) == 2
    return counter.steps


def test_a_fit_step_waits_for_the_device_only_where_the_model_does(tmp_path: Path, monkeypatch) -> None:
    """A smoke ``fit`` step with the default callbacks and the precision plugin: the module, the data module
    (crowd instances dropped on the host), the plugin and the callbacks add no host sync to the model's own
    after the first step.
    """
    from host_syncs import package_sites

    for step, syncs in enumerate(_fit_step_syncs(tmp_path, monkeypatch)):
        ours = {site.rsplit(":", 1)[0] for site in package_sites(syncs)}
        # the first step reads once more: SGD creates its momentum buffers, and the host decides whether to
        # keep them (tests/test_precision_guard.py)
        assert ours == ({"models/ext_ops.py", "precision/skip.py"} if step == 0 else {"models/ext_ops.py"}), (
            syncs.table()
        )


@pytest.mark.parametrize(
    "precision",
    [[], ["trainer.precision=16-mixed", "precision.fp16_on_cpu=true"], ["data.pad_instances=8"]],
    ids=["auto", "16-mixed", "padded-targets"],
)
def test_a_sync_free_fit_step_never_waits_for_the_device(tmp_path: Path, monkeypatch, precision) -> None:
    """With ``speedups.sync_free`` on the CPU, a whole fit step after the first (module, model, plugin,
    callbacks, optimizer; under 16-mixed the loss scaler too, which takes a fused optimizer's step without
    reading its ``found_inf``) makes no host sync at all.
    """
    first, second = _fit_step_syncs(
        tmp_path, monkeypatch, ["speedups.sync_free.devices=[cpu,cuda]", *precision]
    )
    assert second.total == 0, second.table()

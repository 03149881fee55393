"""lit_amp_det.cpu_heap and the RetainCPUHeap callback: freed heap is reused without page faults while retained,
the measurement pin/unpin hands back the policy in force, and the callback applies only on a CPU and undoes
itself at teardown."""

from __future__ import annotations

import subprocess
import sys
import types
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lit_amp_det import cpu_heap
from lit_amp_det.callbacks import RetainCPUHeap

GLIBC = pytest.mark.skipif(getattr(cpu_heap._LIBC, "mallopt", None) is None, reason="needs glibc's mallopt")

_MB = 2**20


#: Run in a fresh interpreter: in a process that has run other tests glibc may hold a free 64 MB chunk already, which
#: it serves without mmap (and so without faults) whatever the threshold says. The second request is smaller than the
#: freed block: torch allocates with posix_memalign, which asks glibc for the size plus the alignment, so a freed
#: block of exactly the requested size does not always fit a request of that size again.
_FAULTS_SCRIPT = """
import torch
from lit_amp_det import cpu_heap
from lit_amp_det.profiling import minor_page_faults

def faults_of_fresh_tensor(mb):
    before = minor_page_faults()
    tensor = torch.ones(mb * 2**20 // 4)
    assert tensor.sum() == tensor.numel()  # every page written
    del tensor
    return minor_page_faults() - before

cpu_heap.pin_malloc_threshold()  # large blocks mmap'd and returned: every allocation faults its pages in
faults_of_fresh_tensor(64)
pinned = faults_of_fresh_tensor(60)
cpu_heap.unpin_malloc_threshold()
assert cpu_heap.retain_freed_memory() and cpu_heap.retains_freed_memory()
faults_of_fresh_tensor(64)  # grows the heap once
retained = faults_of_fresh_tensor(60)  # served from the freed 64 MB
cpu_heap.return_freed_memory()
assert not cpu_heap.retains_freed_memory()
print(pinned, retained)
"""


@GLIBC
def test_retained_heap_serves_a_freed_block_again_without_page_faults() -> None:
    pages = 60 * _MB // 4096
    proc = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pinned, retained = map(int, proc.stdout.split()[-2:])
    assert pinned > 0.9 * pages and retained < 0.1 * pages, (pinned, retained)


class _FakeLibc:
    """Records ``mallopt``/``malloc_trim`` calls instead of changing this process's heap."""

    def __init__(self) -> None:
        self.settings: dict[int, int] = {}
        self.trims = 0

    def mallopt(self, param: int, value: int) -> int:
        self.settings[param] = value
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.trims += 1
        return 1


@pytest.fixture
def fake_libc(monkeypatch: pytest.MonkeyPatch) -> _FakeLibc:
    libc = _FakeLibc()
    monkeypatch.setattr(cpu_heap, "_LIBC", libc)
    monkeypatch.setattr(cpu_heap, "_retained", False)
    return libc


def test_unpin_restores_whichever_policy_was_in_force(fake_libc: _FakeLibc) -> None:
    mmap_max, mmap_threshold = cpu_heap._M_MMAP_MAX, cpu_heap._M_MMAP_THRESHOLD
    trim_threshold = cpu_heap._M_TRIM_THRESHOLD
    cpu_heap.pin_malloc_threshold(256 * 1024)
    assert fake_libc.settings[mmap_threshold] == 256 * 1024 and fake_libc.trims == 1
    cpu_heap.unpin_malloc_threshold()  # not retained: glibc's long-running thresholds
    assert fake_libc.settings == {mmap_max: 65536, mmap_threshold: 32 * _MB, trim_threshold: 64 * _MB}

    assert cpu_heap.retain_freed_memory()
    assert fake_libc.settings[mmap_max] == 0 and fake_libc.settings[trim_threshold] == 2**31 - 1
    cpu_heap.pin_malloc_threshold()  # measuring re-enables mmap for the one step...
    assert fake_libc.settings[mmap_max] == 65536 and fake_libc.settings[mmap_threshold] == 128 * 1024
    cpu_heap.unpin_malloc_threshold()  # ...and the retained policy comes back afterwards
    assert fake_libc.settings[mmap_max] == 0 and fake_libc.settings[trim_threshold] == 2**31 - 1
    assert cpu_heap.retains_freed_memory()

    trims = fake_libc.trims
    cpu_heap.return_freed_memory()
    assert fake_libc.settings == {mmap_max: 65536, mmap_threshold: 32 * _MB, trim_threshold: 64 * _MB}
    assert fake_libc.trims == trims + 1 and not cpu_heap.retains_freed_memory()
    cpu_heap.return_freed_memory()  # a second call changes nothing
    assert fake_libc.trims == trims + 1


def test_callback_applies_on_a_cpu_module_only_and_undoes_itself(fake_libc: _FakeLibc) -> None:
    callback = RetainCPUHeap()
    on_gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    callback.on_fit_start(None, on_gpu)
    assert not callback.applied and fake_libc.settings == {}

    on_cpu = types.SimpleNamespace(device=torch.device("cpu"))
    callback.on_fit_start(None, on_cpu)
    callback.on_validation_start(None, on_cpu)  # fit's validation: already applied
    assert callback.applied and cpu_heap.retains_freed_memory()
    assert fake_libc.settings[cpu_heap._M_MMAP_MAX] == 0
    callback.teardown(None, on_cpu, "fit")
    assert not callback.applied and not cpu_heap.retains_freed_memory()
    assert fake_libc.settings[cpu_heap._M_MMAP_MAX] == 65536
    callback.on_predict_start(None, on_cpu)  # a later predict applies it again
    assert callback.applied
    callback.teardown(None, on_cpu, "predict")


def test_callback_warns_once_without_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_heap, "_LIBC", None)
    monkeypatch.setattr(cpu_heap, "_retained", False)
    callback = RetainCPUHeap()
    on_cpu = types.SimpleNamespace(device=torch.device("cpu"))
    with pytest.warns(UserWarning, match="mallopt is not available"):
        callback.on_fit_start(None, on_cpu)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        callback.on_validation_start(None, on_cpu)
    assert caught == []  # warned once per callback, not once per stage
    assert not callback.applied and not cpu_heap.retains_freed_memory()


def test_callback_holds_the_policy_for_the_whole_fit(fake_libc: _FakeLibc, tmp_path) -> None:
    seen: list[bool] = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, *args) -> None:
            seen.append(cpu_heap.retains_freed_memory())

        def on_validation_batch_start(self, *args) -> None:
            seen.append(cpu_heap.retains_freed_memory())

    trainer = pl.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=3, limit_val_batches=1,
                         val_check_interval=2, callbacks=[RetainCPUHeap(), Spy()], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(BoringModel())
    assert len(seen) >= 4 and all(seen)
    assert not cpu_heap.retains_freed_memory()  # teardown restored glibc's policy


def test_bench_peak_of_measures_a_retained_heap_as_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinning would hand the kept heap back before the step and hide memory the row really holds."""
    from lit_amp_det.bench import e2e_rows

    calls: list[str] = []
    monkeypatch.setattr(e2e_rows, "retains_freed_memory", lambda: True)
    monkeypatch.setattr(e2e_rows, "pin_malloc_threshold", lambda: calls.append("pin"))
    monkeypatch.setattr(e2e_rows, "release_freed_cpu_memory", lambda: calls.append("release"))
    monkeypatch.setattr(e2e_rows, "unpin_malloc_threshold", lambda: calls.append("unpin"))
    memory = e2e_rows.PeakMemory("cpu")
    memory.peak_of(lambda: calls.append("step"))
    assert calls == ["step"]
    assert "retains its CPU heap" in memory.method

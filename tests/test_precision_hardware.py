"""``trainer.precision=auto`` and the CPU fallbacks: each device gets the precision it runs fast, and says
why.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch

from conftest import SMOKE, compose_config, only_run_dir, run_cli
from lit_amp_det.app.config import check_config
from lit_amp_det.precision import (
    DetectionMixedPrecision,
    FiniteStepPrecision,
    MasterWeightPrecision,
    build_precision_plugin,
    hardware,
    trained_precision,
    warn_if_precision_changes,
)
from lit_amp_det.precision.hardware import cpu_computes_bf16_natively, resolve_precision
from lit_amp_det.precision.modes import PRECISIONS


def _resolve_quietly(precision: str, device: str, fp16_on_cpu: bool = False) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning allowed
        return resolve_precision(precision, device, fp16_on_cpu)


@pytest.mark.parametrize(("native", "expected"), [(True, "bf16-mixed"), (False, "32-true")])
def test_auto_on_a_cpu_follows_native_bf16(
    cpu_bf16, caplog: pytest.LogCaptureFixture, native: bool, expected: str
) -> None:
    cpu_bf16(native)
    with caplog.at_level(logging.INFO):
        assert _resolve_quietly("auto", "cpu") == expected
    said = caplog.text
    assert f"trainer.precision=auto: {expected}" in said
    assert ("computes bf16 natively" in said) == native
    assert ("no native bf16" in said and "12x slower" in said) == (not native)


def test_auto_on_cuda_is_fp16_autocast(cpu_bf16) -> None:
    cpu_bf16(False)  # the CPU does not matter on a GPU
    assert _resolve_quietly("auto", "cuda") == "16-mixed"


@pytest.mark.parametrize("precision", ["16-mixed", "16-weights"])
def test_fp16_on_a_cpu_without_native_bf16_runs_fp32(cpu_bf16, precision: str) -> None:
    cpu_bf16(False)
    with pytest.warns(UserWarning, match=rf"{precision}.*32-true.*fp16_on_cpu=true"):
        assert resolve_precision(precision, "cpu") == "32-true"
    cpu_bf16(True)
    with pytest.warns(UserWarning, match=rf"{precision}.*bf{precision}"):
        assert resolve_precision(precision, "cpu") == f"bf{precision}"
    assert _resolve_quietly(precision, "cpu", fp16_on_cpu=True) == precision  # forced: as asked, no warning


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-weights"])
def test_explicit_bf16_is_kept_and_warned_about_without_native_bf16(cpu_bf16, precision: str) -> None:
    cpu_bf16(False)
    with pytest.warns(
        UserWarning,
        match=rf"trainer.precision={precision}: this CPU has no native bf16 .*"
        r"trainer.precision=auto \(32-true here\)",
    ):
        assert resolve_precision(precision, "cpu") == precision
    cpu_bf16(True)
    assert _resolve_quietly(precision, "cpu") == precision
    assert _resolve_quietly(precision, "cuda") == precision


def test_other_values_pass_through(cpu_bf16) -> None:
    cpu_bf16(False)
    assert _resolve_quietly("32-true", "cpu") == "32-true"
    assert _resolve_quietly("16-mixed", "cuda") == "16-mixed"


def test_the_plugin_is_built_for_what_runs(cpu_bf16) -> None:
    cpu_bf16(False)
    assert isinstance(build_precision_plugin("auto", "cpu"), FiniteStepPrecision)
    with pytest.warns(UserWarning, match=r"16-weights.*32-true"):
        assert isinstance(build_precision_plugin("16-weights", "cpu"), FiniteStepPrecision)
    cpu_bf16(True)
    plugin = build_precision_plugin("auto", "cpu")
    assert isinstance(plugin, DetectionMixedPrecision) and plugin.precision == "bf16-mixed"
    with pytest.warns(UserWarning, match=r"16-weights.*bf16-weights"):
        assert isinstance(build_precision_plugin("16-weights", "cpu"), MasterWeightPrecision)
    with pytest.raises(ValueError, match=r"trainer\.precision='automatic'.*auto, 32-true"):
        build_precision_plugin("automatic", "cpu")


def test_native_bf16_is_torchs_own_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer is torch's oneDNN bf16 device check; without that private op, torch's CPU capability
    decides.
    """
    probe = hardware._native_bf16
    probe.cache_clear()
    try:
        assert cpu_computes_bf16_natively() == torch.ops.mkldnn._is_mkldnn_bf16_supported()
        monkeypatch.setattr(hardware, "_torch_bf16_op", lambda: None)
        for capability, native in [("AVX2", False), ("DEFAULT", False), ("AVX512", True)]:
            monkeypatch.setattr(hardware, "cpu_capability", lambda c=capability: c)
            probe.cache_clear()
            assert cpu_computes_bf16_natively() is native

        def refusing_op() -> bool:
            raise RuntimeError("mkldnn bf16 check unavailable")

        monkeypatch.setattr(
            hardware, "_torch_bf16_op", lambda: refusing_op
        )  # torch's op fails: capability decides
        for capability, native in [("AVX2", False), ("AMX", True)]:
            monkeypatch.setattr(hardware, "cpu_capability", lambda c=capability: c)
            probe.cache_clear()
            assert cpu_computes_bf16_natively() is native
    finally:
        probe.cache_clear()


def test_cpu_capability_without_torchs_answer_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    assert hardware.cpu_capability() == str(torch.backends.cpu.get_cpu_capability())

    def missing() -> str:
        raise RuntimeError("not built with CPU capability detection")

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", missing)
    assert hardware.cpu_capability() == "unknown"
    monkeypatch.delattr(torch.backends.cpu, "get_cpu_capability")
    assert hardware.cpu_capability() == "unknown"


def test_auto_is_the_default_and_a_valid_value(tmp_path: Path) -> None:
    cfg = compose_config([], tmp_path)
    assert cfg.trainer.precision == "auto" and "auto" in PRECISIONS
    check_config(cfg)
    assert compose_config(["trainer=gpu"], tmp_path).trainer.precision == "16-mixed"


@pytest.mark.slow
def test_metrics_json_records_the_precision_that_ran_and_a_resume_in_another_warns(tmp_path: Path) -> None:
    """A fit with ``trainer.precision=auto`` records what auto chose on this machine (and logs it); resuming
    its checkpoint in another precision (as ``auto`` does on a machine with other bf16 support) says so.
    """
    proc = run_cli(["fit", *SMOKE, "trainer.max_steps=1", "+trainer.limit_val_batches=1"], cwd=tmp_path)
    run_dir = only_run_dir(tmp_path / "runs")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    expected = "bf16-mixed" if cpu_computes_bf16_natively() else "32-true"
    assert metrics["precision"] == expected
    assert f"trainer.precision=auto: {expected}" in proc.stdout + proc.stderr
    assert trained_precision(torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)) == expected

    other = "32-true" if expected == "bf16-mixed" else "bf16-mixed"
    resumed = run_cli(
        [
            "fit",
            *SMOKE,
            "trainer.max_steps=2",
            "+trainer.limit_val_batches=1",
            f"trainer.precision={other}",
            f"ckpt_path={run_dir}",
        ],
        cwd=tmp_path,
    )
    output = " ".join((resumed.stdout + resumed.stderr).split())  # the warning may wrap
    assert f"was trained in {expected}; this fit continues it in {other}" in output
    assert f"Pass trainer.precision={expected} to continue as it was trained" in output


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-weights", "16-weights"])
def test_every_plugin_records_its_precision_in_the_checkpoint(precision: str) -> None:
    """Each plugin's state names its precision (Lightning saves it under the class name), and loads it back,
    as it loads the state of checkpoints saved before the plugins recorded it.
    """
    plugin = build_precision_plugin(precision, "cpu", fp16_on_cpu=True)
    state = plugin.state_dict()
    checkpoint = {type(plugin).__qualname__: state, "state_dict": {}}
    assert trained_precision(checkpoint) == precision
    fresh = build_precision_plugin(precision, "cpu", fp16_on_cpu=True)
    fresh.load_state_dict(state)
    legacy = {key: value for key, value in state.items() if key != "precision"}
    fresh.load_state_dict(legacy)
    assert trained_precision({type(plugin).__qualname__: legacy}) is None
    assert fresh.state_dict() == state


def test_a_precision_change_warns_only_when_the_checkpoint_says_another() -> None:
    checkpoint = {"DetectionMixedPrecision": {"guard": {}, "precision": "bf16-mixed"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_precision_changes(checkpoint, "ckpt_path=a.ckpt", "bf16-mixed") is None
        assert warn_if_precision_changes({"state_dict": {}}, "ckpt_path=a.ckpt", "32-true") is None
    with pytest.warns(
        UserWarning,
        match=r"ckpt_path=a.ckpt was trained in bf16-mixed; this fit continues it in "
        r"32-true .* Pass trainer.precision=bf16-mixed",
    ):
        warn_if_precision_changes(checkpoint, "ckpt_path=a.ckpt", "32-true")

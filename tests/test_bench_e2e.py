"""``bench train``, ``bench infer`` and ``bench precision``: how rows are composed and built, what the report
holds, bad arguments. Nothing here times anything: the figures of these tiny runs are not looked at.

The runs use the tiny model at 64 px, batch 2, one timed step; the ordering, aggregation and state helpers are
tested without processes in ``tests/test_bench_repeats.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from lit_amp_det.bench import e2e
from lit_amp_det.bench.measure import run_row
from lit_amp_det.bench.rows import BENCHES, Bench, Setting, compose, default_rows, row_overrides

SETTING = Setting(
    device="cpu",
    model="maskrcnn_tiny",
    batch=2,
    height=64,
    width=64,
    num_classes=4,
    steps=1,
    warmup=0,
    compile_warmup=1,
    half="fp32",
)
CUMULATIVE = pytest.mark.parametrize("kind", ["train", "infer"])


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and (node or not prefix):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


def _config(bench: Bench, index: int, setting: Setting = SETTING) -> dict[str, Any]:
    return _flat(OmegaConf.to_container(compose(row_overrides(bench, index, setting)), resolve=False))


def _changed(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    return {k for k in before.keys() | after.keys() if before.get(k, "?") != after.get(k, "?")}


def _keys(adds: list[str] | tuple[str, ...]) -> set[str]:
    return {add.split("=", 1)[0].lstrip("+") for add in adds}


@CUMULATIVE
def test_each_row_adds_one_switch_to_the_row_above(kind: str) -> None:
    """The first row is torchvision's fp32 model without callbacks; every later row changes exactly its own
    key.
    """
    bench = BENCHES[kind]
    setting = dataclasses.replace(SETTING, half="bf16")  # every row changes something
    names = [row.name for row in bench.rows]
    assert len(set(names)) == len(names) and names[:5] == [
        "torchvision-fp32",
        "autocast",
        "fp32-regions",
        "ext-ops",
        "channels-last",
    ]
    assert names[-2:] == (["step-graph", "compile"] if kind == "train" else ["compile", "cuda-graphs"])
    previous = _config(bench, 0, setting)
    assert (
        previous["speedups"] == {}
        and previous["callbacks"] == {}
        and previous["trainer.precision"] == "32-true"
    )
    assert previous["optim.optimizer.fused"] is None and previous["precision.fp32_regions"] == {}
    assert previous["model.speedups"] == "${speedups}"  # the module gets the group, as fit gives it
    above = 0  # on a CPU a CUDA row adds nothing to the rows below it
    for index, row in enumerate(bench.rows[1:], start=1):
        overrides = row_overrides(bench, index, setting)
        adds = len(row.adds)
        assert overrides[:-adds] == row_overrides(bench, above, setting)
        assert adds == (3 if (kind, row.name) == ("train", "sync-free") else 1), (
            row.name
        )  # + its padded targets
        flat = _config(bench, index, setting)
        changed = _changed(previous, flat)
        inside = [
            k
            for k in changed
            for key in _keys(row.adds)
            if k == key or k.startswith(key + ".") or key.startswith(k + ".")
        ]  # k: {}
        assert changed and len(inside) == len(changed), (row.name, changed)
        if row.when != "cuda":
            above, previous = index, flat
    assert previous["speedups.ext_ops._target_"] == "lit_amp_det.models.speedups.ExtensionOps"
    assert previous["speedups.compile._target_"] == "lit_amp_det.models.speedups.CompileBackbone"


def test_precision_rows_each_add_their_own_settings_to_the_baseline() -> None:
    bench = BENCHES["precision"]
    base = _config(bench, 0)
    for index, row in enumerate(bench.rows[1:], start=1):
        assert row_overrides(bench, index, SETTING)[: -len(row.adds)] == row_overrides(bench, 0, SETTING)
        flat = _config(bench, index)
        assert _changed(base, flat) <= _keys(row.adds) and flat["trainer.precision"] == row.name.removesuffix(
            "-plain"
        )
        assert flat["precision.fp32_regions"] == ({} if row.name.endswith("-plain") else None)


def test_precision_rows_follow_the_device_and_the_chosen_half_precision(cpu_bf16) -> None:
    """``--precision auto`` is ``trainer.precision=auto``'s choice; a named half precision is used as
    named.
    """
    train = BENCHES["train"]
    auto = dataclasses.replace(SETTING, half=None)
    cuda = dataclasses.replace(auto, device="cuda")
    cpu_bf16(True)
    assert row_overrides(train, 1, auto)[-1] == "trainer.precision=bf16-mixed"
    assert row_overrides(train, 7, auto)[-1] == "trainer.precision=bf16-weights"
    assert row_overrides(train, 1, cuda)[-1] == "trainer.precision=16-mixed"
    cpu_bf16(False)
    assert row_overrides(train, 1, auto)[-1] == "trainer.precision=32-true"
    assert row_overrides(train, 7, cuda)[-1] == "trainer.precision=16-weights"
    fp16 = row_overrides(train, 7, dataclasses.replace(SETTING, half="fp16"))
    assert (
        fp16[-1] == "trainer.precision=16-weights" and "precision.fp16_on_cpu=true" in fp16
    )  # fp16 as asked


@pytest.mark.parametrize("kind", ["train", "infer", "precision"])
def test_default_rows_leave_out_what_changes_nothing_here(kind: str) -> None:
    """fp32 runs leave out the rows that only act in half precision; a CPU leaves out the fp16 precision
    rows.
    """
    bench = BENCHES[kind]
    half = default_rows(bench, dataclasses.replace(SETTING, half="bf16"))
    fp32 = default_rows(bench, SETTING)
    cuda = default_rows(bench, dataclasses.replace(SETTING, device="cuda", half="fp16"))
    assert cuda == [row.name for row in bench.rows]
    if kind == "precision":
        assert half == fp32 == ["32-true", "bf16-mixed", "bf16-mixed-plain", "bf16-weights"]
    else:
        assert half == [name for name in cuda if name not in ("cuda-graphs", "step-graph")]  # CUDA's own rows
        assert not {"autocast", "fp32-regions", "low-precision-weights", "cuda-graphs", "step-graph"} & set(
            fp32
        )
        assert {"torchvision-fp32", "ext-ops", "channels-last", "compile"} <= set(fp32)


def test_a_training_row_builds_every_switch_but_compile_as_fit_does() -> None:
    """The half-weights row (every train switch but compile) runs through Lightning with each switch in
    force.
    """
    train = BENCHES["train"]
    index = [row.name for row in train.rows].index("low-precision-weights")
    result = run_row(train, index, dataclasses.replace(SETTING, half="bf16"))
    assert result["precision"] == "bf16-weights" and result["speedups"] == ["ext_ops", "channels_last"]
    assert result["callbacks"] == ["FreezeNorm", "ConvBNEval"] and result["optimizer"]["fused"] is True
    assert len(result["step_ms_all"]) == 1 and result["images_per_s"] > 0 and result["warmup_steps"] == 0
    assert result["peak_memory_abs_mb"] > 0 and len(result["weights_sha256"]) == 64


def test_an_inference_row_folds_conv_bn_and_pastes_binary_masks() -> None:
    infer = BENCHES["infer"]
    index = [row.name for row in infer.rows].index("convbn-fold")
    result = run_row(infer, index, dataclasses.replace(SETTING, warmup=1))
    assert result["speedups"] == ["ext_ops", "channels_last", "binary_mask_paste"]
    assert result["callbacks"] == ["ConvBNEval"] and result["precision"] == "32-true"
    assert len(result["latency_ms_all"]) == len(result["batch_ms_all"]) == 1 and result["warmup_steps"] == 2
    assert result["detections_per_call"] >= 0 and "optimizer" not in result


@pytest.mark.slow
def test_bench_train_runs_rows_in_processes_and_writes_the_report(tmp_path: Path) -> None:
    """Two rows, two repeats each, in rotated rounds; every repeat loaded the state the bench made first."""
    names = [
        "torchvision-fp32",
        "fused-optim",
    ]  # it carries every switch but compile (fp32: no precision rows)
    env = {**os.environ, "LIT_AMP_DET_RUNS": str(tmp_path / "runs")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lit_amp_det",
            "bench",
            "train",
            "--model=maskrcnn_tiny",
            "--size=64",
            "--batch=2",
            "--warmup=0",
            "--steps=1",
            "--state-steps=1",
            "--precision=fp32",
            f"--rows={','.join(reversed(names))}",
            "--repeats=2",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (out,) = (tmp_path / "runs" / "bench" / "train").iterdir()
    report = json.loads((out / "bench_train.json").read_text())
    table = (out / "bench_train.md").read_text()
    assert str(out) in proc.stdout and table.strip() in proc.stdout
    rows, state = report["rows"], report["state"]
    assert [row["name"] for row in rows] == names and all(row["status"] == "ok" for row in rows)
    assert [(run["round"], run["row"]) for run in report["run_order"]] == [
        (0, names[0]),
        (0, names[1]),
        (1, names[1]),
        (1, names[0]),
    ]
    assert report["setting"]["weights"] == state["file"] and Path(state["file"]).is_file()
    for row in rows:
        runs = row["repeat_results"]
        assert [run["weights_sha256"] for run in runs] == [state["weights_sha256"]] * 2
        assert all(run["lr"] == state["final_lr"] for run in runs)
        assert row["step_ms_repeat_medians"] == [run["step_ms_median"] for run in runs]
        assert row["images_per_s"] == pytest.approx(2000 / row["step_ms_median"])
    assert rows[0]["speedup"] == 1.0 and rows[0]["vs_above"] is None
    assert (
        rows[1]["speedup"]
        == rows[1]["vs_above"]
        == pytest.approx(rows[1]["images_per_s"] / rows[0]["images_per_s"])
    )
    assert rows[1]["adds"] == ["optim.optimizer.fused=auto"]
    # the host syncs of the memory step: torchvision's ops wait for the device more often than lit_amp_det's
    assert rows[0]["host_syncs_per_step"] > rows[1]["host_syncs_per_step"] > 0
    assert rows[1]["speedups"] == ["ext_ops", "channels_last"] and rows[1]["optimizer"]["fused"] is True
    assert (
        "| 2 | + fused SGD | `optim.optimizer.fused=auto` |" in table
        and state["weights_sha256"][:12] in table
    )
    # each repeat was kept as it finished (a run cut short by a time limit keeps them) and named in the log
    kept = [json.loads(line) for line in (out / "bench_train_repeats.jsonl").read_text().splitlines()]
    assert [(run["round"], run["row"]) for run in kept] == [
        (0, names[0]),
        (0, names[1]),
        (1, names[1]),
        (1, names[0]),
    ]
    assert proc.stderr.count("step median") == 4


@pytest.mark.long
def test_the_compile_row_compiles_the_backbone() -> None:
    """``torch.compile`` of the backbone under Lightning (long: Inductor compiles its forward and
    backward).
    """
    train = BENCHES["train"]
    result = run_row(train, len(train.rows) - 1, dataclasses.replace(SETTING, compile_warmup=1))
    assert result["speedups"] == ["ext_ops", "channels_last", "compile"] and result["warmup_steps"] == 1


@pytest.mark.slow
def test_a_failed_row_becomes_a_table_line(tmp_path: Path) -> None:
    """A row whose process fails is reported with its error's last line; the row after it compares with the
    last row that ran.
    """
    train = BENCHES["train"]
    failed = e2e.run_row_process(train, 1, dataclasses.replace(SETTING, model="no_such_model"))
    assert failed["status"] == "failed" and "no_such_model" in failed["error"] and failed["returncode"] == 2
    ok = {
        "status": "ok",
        "step_ms_median": 100.0,
        "step_ms_repeat_medians": [100.0],
        "step_ms_repeat_spread": 0.0,
        "images_per_s": 20.0,
        "peak_memory_mb": 50.0,
        "warmup_s": 0.5,
        "warmup_steps": 1,
        "repeats": 1,
    }
    rows = [
        {"name": "torchvision-fp32", "label": "torchvision fp32 eager", "adds": [], **ok},
        {"name": "autocast", "label": "+ torch.autocast", "adds": ["trainer.precision=bf16-mixed"], **failed},
        {"name": "ext-ops", "label": "+ lit_amp_det ops", "adds": ["x=1"], **ok, "images_per_s": 10.0},
    ]
    run = {
        "command": "python -m lit_amp_det bench train",
        "environment": e2e._environment("cpu"),
        "state": None,
        "repeats": 1,
    }
    text = e2e.write_report(train, rows, SETTING, run, tmp_path)
    assert f"| 2 | + torch.autocast | `trainer.precision=bf16-mixed` | **failed**: {failed['error']}" in text
    assert "| 3 | + lit_amp_det ops | `x=1` | 100.0 | - | 10.00 | 0.50x | 0.50x | 50 | 1.00x |" in text
    report = json.loads((tmp_path / "bench_train.json").read_text())
    assert [row["status"] for row in report["rows"]] == ["ok", "failed", "ok"]


@pytest.mark.parametrize(
    ("argv", "option", "message"),
    [
        (["--rows=torchvision-fp32,warp-drive"], "--rows", "warp-drive"),
        (["--batch=0"], "--batch", "must be >= 1, got 0"),
        (["--steps=0"], "--steps", "must be >= 1"),
        (["--size=big"], "--size", "HEIGHTxWIDTH"),
        (["--model=resnet9000"], "--model", "conf/model/resnet9000.yaml"),
        (["--repeats=0"], "--repeats", "must be >= 1, got 0"),
        (["--state=warm"], "--state", "invalid choice: 'warm'"),
    ],
)
@pytest.mark.parametrize("kind", ["train", "infer", "precision"])
def test_bad_arguments_name_the_option(
    kind: str, argv: list[str], option: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        e2e.main(kind, argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert option in err and message in err, err


def test_one_process_runs_the_rows_here_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--one-process`` (``make gpu-check``'s quick rows): no row process is started; each row is built anew
    from the same state, and the report names how the rows ran.
    """
    monkeypatch.setattr(e2e, "run_row_process", None)  # a row process would fail the run
    names = ["torchvision-fp32", "fused-optim"]
    e2e.main(
        "train",
        [
            "--model=maskrcnn_tiny",
            "--size=64",
            "--batch=2",
            "--warmup=0",
            "--steps=1",
            "--precision=fp32",
            "--state=random",
            "--repeats=1",
            f"--rows={','.join(names)}",
            "--one-process",
            f"--out={tmp_path}",
        ],
    )
    report = json.loads((tmp_path / "bench_train.json").read_text())
    rows = report["rows"]
    assert [row["name"] for row in rows] == names and all(row["status"] == "ok" for row in rows)
    assert rows[0]["weights_sha256"] == rows[1]["weights_sha256"], "one model state for every row"
    assert report["one_process"] and "all in one process" in (tmp_path / "bench_train.md").read_text()


def test_one_process_refuses_rows_that_compile(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        e2e.main("train", ["--rows=sync-free,compile", "--one-process", "--state=random"])
    assert exit_info.value.code == 2 and "['compile'] compile" in capsys.readouterr().err


def test_a_row_that_raises_in_one_process_is_a_failed_row(monkeypatch: pytest.MonkeyPatch) -> None:
    from lit_amp_det.bench import measure

    def refuse(bench: Bench, index: int, setting: Setting) -> dict[str, Any]:
        raise RuntimeError("callbacks.cuda_graph cannot capture this training step: it runs on cpu\nmore")

    monkeypatch.setattr(measure, "run_row", refuse)
    result = e2e.run_row_here(BENCHES["train"], 0, SETTING)
    assert (
        result["status"] == "failed" and result["error"].endswith("it runs on cpu") and result["wall_s"] >= 0
    )

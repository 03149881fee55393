"""``bench train`` and ``bench infer``: how rows are built, what the reports hold, bad arguments. No timing tests.

The runs use the tiny model at 64 px, batch 2, one warm-up and two timed steps, a state trained for 2 steps and
quick peak matmuls; the row subsets skip the compile row except in the one test marked ``slow``. The ordering,
aggregation, state and roofline helpers are tested without processes in ``tests/test_bench_repeats.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from lit_amp_det.bench import e2e, e2e_report, e2e_rows, infer, train
from lit_amp_det.bench.common import compose
from lit_amp_det.cpu_heap import release_freed_cpu_memory, retains_freed_memory

# bf16 rows named explicitly: ``--precision auto`` would run fp32 rows on a CI machine without native bf16
SMALL = ["--model=maskrcnn_tiny", "--size=64", "--batch=2", "--warmup=1", "--steps=2", "--state-steps=2",
         "--peak-seconds=0.02", "--precision=bf16"]
SETTING = e2e_rows.Setting(device="cpu", model="maskrcnn_tiny", batch=2, height=64, width=64, num_classes=4,
                           steps=1, warmup=0, compile_warmup=1, half="bf16")
BENCHES = pytest.mark.parametrize("bench", [train.BENCH, infer.BENCH], ids=["train", "infer"])
PNG = b"\x89PNG\r\n\x1a\n"


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        if not node and prefix:
            return {prefix: {}}
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


@BENCHES
def test_each_row_is_the_previous_rows_overrides_plus_one_switch(bench: e2e_rows.Bench) -> None:
    """Every row composes, extends the previous row's list by one override, and changes exactly that key."""
    assert bench.rows[0].override is None and len(bench.rows) == (17 if bench is train.BENCH else 16)
    names = [row.name for row in bench.rows]
    assert len(set(names)) == len(names)
    previous: list[str] = []
    previous_cfg: dict[str, Any] = {}
    for index, row in enumerate(bench.rows):
        overrides = e2e_rows.row_overrides(bench.rows, index, SETTING)
        flat = _flat(OmegaConf.to_container(compose(overrides), resolve=False))
        if index == 0:
            assert flat["model.ops"] == "torchvision" and flat["trainer.precision"] == "32-true"
            assert flat["callbacks"] == {} and flat["optim.optimizer.fused"] is None
            assert flat["model.channels_last"] is False and flat["model.compile"] is None
            assert flat["model.binary_mask_paste"] is False  # torchvision's mask paste
        else:
            assert overrides[: len(previous)] == previous and len(overrides) == len(previous) + 1
            key = overrides[-1].split("=", 1)[0]
            changed = {k for k in flat.keys() | previous_cfg.keys() if flat.get(k, "?") != previous_cfg.get(k, "?")}
            assert changed, f"row {row.name}: {overrides[-1]} changed nothing in the composed config"
            outside = sorted(k for k in changed if k != key and not k.startswith(key + "."))
            assert not outside, f"row {row.name}: {overrides[-1]} also changed {outside}"
        previous, previous_cfg = overrides, flat


def test_mixed_precision_row_follows_the_device(cpu_bf16) -> None:
    """``--precision auto`` is ``trainer.precision=auto``'s choice; a named half precision is used as named."""
    auto = dataclasses.replace(SETTING, half=None)
    cuda = dataclasses.replace(auto, device="cuda")
    cpu_bf16(True)
    assert e2e_rows.row_overrides(train.ROWS, 1, auto)[-1] == "trainer.precision=bf16-mixed"
    assert e2e_rows.row_overrides(train.ROWS, 7, auto)[-1] == "trainer.precision=bf16-weights"
    assert e2e_rows.row_overrides(train.ROWS, 1, cuda)[-1] == "trainer.precision=16-mixed"
    cpu_bf16(False)
    assert e2e_rows.row_overrides(train.ROWS, 1, auto)[-1] == "trainer.precision=32-true"
    assert e2e_rows.row_overrides(train.ROWS, 7, auto)[-1] == "trainer.precision=32-true"
    assert e2e_rows.row_overrides(train.ROWS, 1, cuda)[-1] == "trainer.precision=16-mixed"
    assert e2e_rows.row_overrides(train.ROWS, 1, SETTING)[-1] == "trainer.precision=bf16-mixed"  # named: kept
    fp16 = e2e_rows.row_overrides(train.ROWS, 7, dataclasses.replace(SETTING, half="fp16"))
    assert fp16[-1] == "trainer.precision=16-weights" and "precision.fp16_on_cpu=true" in fp16  # fp16 as asked


@BENCHES
def test_fp32_runs_leave_out_the_rows_that_change_nothing_in_fp32(bench: e2e_rows.Bench, cpu_bf16) -> None:
    """With fp32 precision rows (``--precision fp32``, or auto without native bf16) the rows that only act in
    fp16/bf16 are left out by default; every row kept changes the config, and every row runs ``32-true``."""
    fp32 = dataclasses.replace(SETTING, half="fp32")
    kept = e2e.default_rows(bench, fp32)
    assert e2e.default_rows(bench, SETTING) == [row.name for row in bench.rows if not row.needs_fp32]
    assert [row.name for row in bench.rows if row.needs_fp32] == ["winograd-4x4"]  # F(4x4) acts in fp32 only
    cpu_bf16(False)
    assert e2e.default_rows(bench, dataclasses.replace(SETTING, half=None)) == kept  # auto: fp32 on such a CPU
    cpu_bf16(True)
    assert e2e.default_rows(bench, dataclasses.replace(SETTING, half="auto")) == e2e.default_rows(bench, SETTING)
    assert kept == [row.name for row in bench.rows if not row.needs_half]
    assert {"torchvision-fp32", "ext-ops", "channels-last", "labelled-mask-logits"} <= set(kept)
    assert {"winograd", "winograd-backbone", "winograd-4x4"} <= set(kept)  # fp32 Winograd pays on the CPU
    assert not {"autocast", "low-precision-weights", "pointwise-matmul"} & set(kept)
    configs = [_flat(OmegaConf.to_container(compose(e2e_rows.row_overrides(bench.rows, i, fp32)), resolve=False))
               for i in range(len(bench.rows))]
    assert all(flat["trainer.precision"] == "32-true" for flat in configs)
    assert configs[1] == configs[0]  # autocast in fp32: nothing
    for index, row in enumerate(bench.rows[1:], start=1):
        if row.name in kept:
            assert configs[index] != configs[index - 1], row.name


@BENCHES
def test_every_row_but_compile_builds_and_runs_in_process(bench: e2e_rows.Bench) -> None:
    """Each row's switches reach the built module (the compile row is covered by the slow test below)."""
    results = {row.name: bench.run_row(i, SETTING) for i, row in enumerate(bench.rows) if row.name != "compile"}
    assert len(results) == len(bench.rows) - 1
    for name, result in results.items():
        speed = result["images_per_s"]
        assert speed > 0 and result["peak_memory_abs_mb"] > 0, (name, result)
        before, after = result["host_copy_gbps"]  # the host's phase, before the warm-up and after the timed steps
        assert before > 0 and after > 0, (name, result["host_copy_gbps"])
    # the same seeded weights in every row, and the same maths counted (the rows change how, not what); the extra
    # rows of lit_amp_det.models.bounded_matmul are counted as the work they are: a chunked product's overlapping
    # rows (< 0.1 %) and, at inference, the box head's padding to whole granules of rows (< 1 % here)
    assert len({result["weights_sha256"] for result in results.values()}) == 1
    assert len({result["batch_sha256"] for result in results.values()}) == 1
    tolerance = 1e-3 if bench is train.BENCH else 1e-2
    # the own-class mask logits skip the other classes' logit maps, in training and at inference: less work counted
    labelled = list(results).index("labelled-mask-logits")  # that row and every row after it
    before = [r["gflop_per_step"] for r in list(results.values())[:labelled]]
    fewer = [r["gflop_per_step"] for r in list(results.values())[labelled:]]
    assert before == pytest.approx([before[0]] * len(before), rel=tolerance)
    assert fewer == pytest.approx([fewer[0]] * len(fewer), rel=tolerance)
    assert 0 < max(fewer) < 0.999 * before[-1]
    assert all(result["gflop_per_step"] > 0 for result in results.values())
    assert results["torchvision-fp32"]["compute_dtype"] == "fp32" and results["autocast"]["compute_dtype"] == "bf16"
    first, last = results["torchvision-fp32"]["switches"], results[bench.rows[-2].name]["switches"]
    assert first == {"trainer.precision": "32-true", "precision.fp32_regions": {}, "model.ops": "torchvision",
                     "model.channels_last": False, "model.deconv_as_matmul": False, "model.compile": None,
                     "precision.fused_master_step": False, "model.labelled_mask_logits": False,
                     "model.pointwise_conv_as_matmul": False, "model.winograd_convs": [],
                     "model.winograd_output_tile": 2, "model.winograd_weight_tile_cache": False, "callbacks": [],
                     "optim.optimizer.fused": None}
    assert last["trainer.precision"] == ("bf16-weights" if bench is train.BENCH else "bf16-mixed")
    assert last["precision.fp32_regions"] is None
    assert last["model.ops"] == "ext" and last["model.channels_last"] is True
    assert last["model.deconv_as_matmul"] is last["model.labelled_mask_logits"] is True
    assert last["precision.fused_master_step"] is (bench is train.BENCH)
    assert last["model.pointwise_conv_as_matmul"] is True
    assert last["model.winograd_convs"] == ["mask_head", "rpn_head", "fpn", "backbone"]
    assert last["model.winograd_output_tile"] == 4
    assert last["model.winograd_weight_tile_cache"] is (bench is infer.BENCH)  # an inference row only
    if bench is train.BENCH:
        assert [c.split("(")[0] for c in last["callbacks"]] == ["FreezeNorm", "ConvBNEval", "RetainCPUHeap"]
        assert not retains_freed_memory()  # the row's teardown handed glibc's policy back to this process
        assert results["fused-optim"]["optimizer"] == {"type": "lit_amp_det.optim.memory_order.SGD", "fused": True,
                                                       "foreach": None}
        assert results["freeze-norm-convbn"]["optimizer"]["type"] == "torch.optim.sgd.SGD"
        assert results["freeze-norm-convbn"]["optimizer"]["fused"] is False
        assert results["low-precision-weights"]["compute_dtype"] == "bf16"
    else:
        assert last["callbacks"] == ["ConvBNEval(only_when_cheaper=True, fold_on_predict=True)"]
        assert results["convbn-eval"]["norm_layers"] > 0 and results["convbn-fold"]["norm_layers"] == 0


def _run(kind: str, args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, Path]:
    env = {**os.environ, "LIT_AMP_DET_RUNS": str(tmp_path / "runs")}
    proc = subprocess.run([sys.executable, "-m", "lit_amp_det", "bench", kind, *SMALL, *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (out,) = (tmp_path / "runs" / "bench" / kind).iterdir()
    return proc, out


def _check_report(kind: str, proc: subprocess.CompletedProcess, out: Path, names: list[str]) -> dict[str, Any]:
    assert out.name[:4].isdigit() and str(out) in proc.stdout
    report = json.loads((out / f"bench_{kind}.json").read_text())
    table = (out / f"bench_{kind}.md").read_text()
    assert (out / f"bench_{kind}.png").read_bytes()[:8] == PNG
    assert [row["name"] for row in report["rows"]] == names
    assert "- precision rows in bf16 (`--precision`; `bf16-mixed` for autocast" in table
    assert report["setting"]["half"] == "bf16" and isinstance(report["environment"]["cpu_native_bf16"], bool)
    labels = {row.name: row.label for row in (train.ROWS if kind == "train" else infer.ROWS)}
    for name in names:
        assert f"| {labels[name]} |" in table and f"| {labels[name]} |" in proc.stdout
    assert "--steps=2" in report["command"] and f"`{report['command']}`" in table
    assert report["setting"]["model"] == "maskrcnn_tiny" and report["environment"]["torch"] in table
    assert all(row["status"] == "ok" and row["images_per_s"] > 0 for row in report["rows"])
    _check_state_and_roofline(report, table, kind)
    return report


def _check_state_and_roofline(report: dict[str, Any], table: str, kind: str) -> None:
    """Every row and repeat loaded the trained state; the roofline figures follow from the medians and peaks."""
    state, peaks = report["state"], report["peaks"]
    assert report["setting"]["state"] == "trained" and report["setting"]["state_steps"] == 2
    assert report["setting"]["checkpoint"] == state["file"] and Path(state["file"]).is_file()
    assert state["weights_sha256"][:12] in table and "model state: trained" in table
    timing = "step" if kind == "train" else "batch"
    assert len({run["batch_sha256"] for row in report["rows"] for run in row["repeat_results"]}) == 1
    for row in report["rows"]:
        runs = row["repeat_results"]
        assert [run["weights_sha256"] for run in runs] == [state["weights_sha256"]] * report["repeats"]
        assert row[f"{timing}_ms_median"] == statistics.median(run[f"{timing}_ms_median"] for run in runs)
        assert row["gflop_per_step"] > 0 and row["compute_dtype"] in peaks["peaks"]
        assert row["achieved_gflops"] == pytest.approx(row["gflop_per_step"] / (row[f"{timing}_ms_median"] / 1000))
        peak = peaks["peaks"][row["compute_dtype"]]["gflops"]
        assert row["peak_gflops"] == peak and row["peak_fraction"] == pytest.approx(row["achieved_gflops"] / peak)
        if kind == "train":
            assert all(run["lr"] == state["final_lr"] for run in runs)
    assert report["rows"][0]["compute_dtype"] == "fp32" and report["rows"][1]["compute_dtype"] == "bf16"
    assert f"{peaks['peaks']['fp32']['gflops']:.0f} GFLOP/s" in table


def test_bench_train_writes_table_json_and_plot(tmp_path: Path) -> None:
    """Two rows, two repeats each, interleaved; medians of repeat medians, the same state and FLOPs in each."""
    names = ["torchvision-fp32", "deconv-matmul"]  # it carries every switch but compile
    proc, out = _run("train", [f"--rows={','.join(reversed(names))}", "--repeats=2"], tmp_path)
    report = _check_report("train", proc, out, names)
    rows = report["rows"]
    assert [(run["round"], run["row"]) for run in report["run_order"]] == [(0, names[0]), (0, names[1]),
                                                                          (1, names[0]), (1, names[1])]
    assert [run["position"] for run in rows[0]["repeat_results"]] == [0, 2]
    assert [run["position"] for run in rows[1]["repeat_results"]] == [1, 3]
    assert report["repeats"] == 2 and report["order_seed"] is None and "interleaved" in proc.stdout
    for row in rows:
        medians = [run["step_ms_median"] for run in row["repeat_results"]]
        assert row["step_ms_repeat_medians"] == medians and row["step_ms_median"] == (medians[0] + medians[1]) / 2
        assert row["step_ms_repeat_min"] == min(medians) and row["step_ms_repeat_max"] == max(medians)
        assert row["step_ms_repeat_spread"] == pytest.approx((max(medians) - min(medians)) / row["step_ms_median"])
        assert row["images_per_s"] == pytest.approx(2000 / row["step_ms_median"])
    assert rows[1]["gflop_per_step"] == pytest.approx(rows[0]["gflop_per_step"], rel=1e-3)  # + chunk overlaps
    assert rows[1]["speedup"] == pytest.approx(rows[0]["step_ms_median"] / rows[1]["step_ms_median"])
    assert rows[0]["speedup"] == 1.0 and rows[0]["memory_ratio"] in (1.0, None)
    assert rows[0]["vs_previous"] is None and rows[1]["vs_previous"]["speedup"] == rows[1]["speedup"]
    assert rows[1]["speedup"] > 0 and len(rows[1]["step_ms_all"]) == 4 and rows[1]["warmup_steps"] == 1
    assert rows[1]["overrides"][-2:] == ["trainer.precision=bf16-weights", "model.deconv_as_matmul=true"]
    assert rows[1]["compute_dtype"] == "bf16"
    base = rows[0]["overrides"]  # the skipped rows' switches are still in: each row keeps those above it
    assert rows[1]["overrides"][: len(base)] == base and len(rows[1]["overrides"]) == len(base) + 8
    assert rows[1]["switches"]["model.ops"] == "ext" and rows[1]["optimizer"]["fused"] is True
    table = (out / "bench_train.md").read_text()  # where the time goes, row by row
    assert "Where the time of one profiled step goes" in table
    for number, row in enumerate(rows, 1):
        assert 0 < row["flop_ops_ms"] < row["profiled_step_ms"] and row["top_other_ops"]
        assert row["flop_ops_gflops"] > 0  # the median over repeats of each repeat's figure
        assert f"| {number} | {row['label']} | {row['profiled_step_ms']:.0f} |" in table


def test_bench_infer_writes_table_json_and_plot(tmp_path: Path) -> None:
    names = ["torchvision-fp32", "convbn-fold"]
    proc, out = _run("infer", [f"--rows={','.join(names)}", "--repeats=1"], tmp_path)
    rows = _check_report("infer", proc, out, names)["rows"]
    assert rows[0]["latency_speedup"] == 1.0 and rows[0]["throughput_speedup"] == 1.0
    assert rows[1]["latency_ms_repeat_medians"] == [rows[1]["latency_ms_median"]]
    assert rows[1]["latency_ms_median"] > 0 and rows[1]["norm_layers"] == 0
    assert len(rows[1]["latency_ms_all"]) == len(rows[1]["batch_ms_all"]) == 2


@pytest.mark.slow
def test_compile_row_runs(tmp_path: Path) -> None:
    """The compile row alone (slow: Inductor compiles the backbone's forward and backward)."""
    _, out = _run("train", ["--rows=compile", "--compile-warmup=2", "--steps=1", "--repeats=1"], tmp_path)
    (row,) = json.loads((out / "bench_train.json").read_text())["rows"]
    assert row["status"] == "ok", row.get("stderr_tail")
    assert row["switches"]["model.compile"] == "backbone" and row["warmup_steps"] == 2 and row["speedup"] == 1.0
    assert row["gflop_per_step"] > 0  # counted eagerly (force_eager), through the compiled backbone


def test_failed_row_becomes_a_table_line(tmp_path: Path) -> None:
    """A row whose process fails is reported with its error's last line; the other rows still are, and the row after
    it compares with the last row that ran (``vs row above``)."""
    broken = dataclasses.replace(SETTING, model="no_such_model")
    failed = e2e.run_row_process(train.BENCH, 1, broken)
    assert failed["status"] == "failed" and "no_such_model" in failed["error"] and failed["returncode"] == 2
    ok = train.run_row(0, SETTING)
    slower = {**ok, "images_per_s": ok["images_per_s"] / 2}
    rows = [{"name": "torchvision-fp32", "label": "torchvision fp32 eager", "override": None, "status": "ok", **ok},
            {"name": "autocast", "label": "+ torch.autocast", "override": "trainer.precision=bf16-mixed", **failed},
            {"name": "ext-ops", "label": "+ lit_amp_det ops", "override": "model.ops=ext", "status": "ok", **slower}]
    text = e2e_report.write_report(train.BENCH, rows, SETTING, e2e_report.environment("cpu"),
                                   "python -m lit_amp_det bench train", tmp_path)
    assert f"| 2 | + torch.autocast | `trainer.precision=bf16-mixed` | **failed**: {failed['error']}" in text
    assert "| vs row above |" in text and f"| 3 | + lit_amp_det ops | `model.ops=ext` | {slower['images_per_s']:.2f} " \
        "| 0.50x | 0.50x |" in text
    report = json.loads((tmp_path / "bench_train.json").read_text())
    assert [row["status"] for row in report["rows"]] == ["ok", "failed", "ok"] and report["rows"][0]["speedup"] == 1.0
    assert report["rows"][0]["vs_previous"] is None and "vs_previous" not in report["rows"][1]
    assert report["rows"][2]["vs_previous"]["speedup"] == pytest.approx(0.5)  # against row 1, the failed one skipped
    assert (tmp_path / "bench_train.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize(("argv", "option", "message"), [
    (["--rows=torchvision-fp32,warp-drive"], "--rows", "warp-drive"),
    (["--batch=0"], "--batch", "must be >= 1, got 0"),
    (["--steps=0"], "--steps", "must be >= 1"),
    (["--size=big"], "--size", "HEIGHTxWIDTH"),
    (["--model=resnet9000"], "--model", "conf/model/resnet9000.yaml"),
    (["--repeats=0"], "--repeats", "must be >= 1, got 0"),
    (["--state=warm"], "--state", "invalid choice: 'warm'"),
    (["--state-steps=0"], "--state-steps", "must be >= 1"),
    (["--peak-seconds=0"], "--peak-seconds", "must be in (0, 60] seconds, got 0.0"),
])
@pytest.mark.parametrize("bench", [train, infer], ids=["train", "infer"])
def test_bad_arguments_name_the_option(bench: Any, argv: list[str], option: str, message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert option in err and message in err, err


def test_bench_weights_ab_runs_its_variants_side_by_side(tmp_path: Path) -> None:
    """The one-process A/B of low-precision weights, batched mask targets and the fused master step: every variant
    steps and is reported, and the fp32 masters show in the state kept (bf16 weights + fp32 masters and gradients >
    fp32 alone), less the fp32 gradients the fused step never makes."""
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, "-m", "lit_amp_det", "bench", "weights_ab", "--model=maskrcnn_tiny",
                           "--size=64", "--batch=2", "--rounds=1", "--steps=1", "--warmup=0",
                           "--variants=tv-fp32,weights,weights-tv-masks,weights-unfused", f"--json={out}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["tv-fp32", "weights", "weights-tv-masks", "weights-unfused"]
    assert all(r["step_ms"] > 0 and r["peak_step_mb"] > 0 for r in results.values())
    assert results["weights-unfused"]["state_mb"] > results["tv-fp32"]["state_mb"] > results["weights"]["state_mb"]
    assert "trainer.precision=bf16-weights" in results["weights"]["switches"]
    for name in results:
        assert f"| {name} |" in proc.stdout


def test_changing_batches_measure_what_a_row_keeps() -> None:
    """--drift-steps: the steps see new shapes images each, and the growth of the heap in use and of the resident set
    is reported over all of them and over their second half: a step that keeps 4 MB more each time reads about
    4 MB a step in both halves."""
    kept: list[bytes] = []
    seen: list[int] = []
    release_freed_cpu_memory()  # freed pages an earlier test left resident would hold the kept bytes unseen

    def keeping_step(k: int, batch: Any) -> None:
        images, targets = batch
        assert len(images) == 2 and images[0].shape == (3, 64, 64) and len(targets) == 2
        seen.append(int(images[0].sum()))
        kept.append(bytes(range(256)) * (4 * 2**20 // 256))

    drift = e2e_rows.memory_over_changing_batches(keeping_step, dataclasses.replace(SETTING, drift_steps=6), "train")
    assert len(set(seen)) == 6  # a new batch every step
    assert drift["drift_steps"] == 6
    assert 22 <= drift["drift_heap_growth_mb"] <= 26 and 10 <= drift["drift_heap_growth_late_mb"] <= 14
    assert 22 <= drift["drift_resident_growth_mb"] <= 40  # at least what was kept (plus the rendering's pages)
    assert e2e_rows.memory_over_changing_batches(keeping_step, SETTING, "train") == {}
    text = e2e_rows.drift_text({"drift_steps": 6, **{k: v for k, v in drift.items() if k != "drift_steps"}})
    assert text.startswith("+2") and text.endswith("in 6") and e2e_rows.drift_text({}) == "-"


def test_a_row_reports_its_changing_batch_steps() -> None:
    """In a row (own-class logits: every switch but the 1x1 and Winograd convolutions) the drift steps run after the
    measured ones, which keep their losses, and --drift-steps travels to the row's process."""
    index = [row.name for row in train.ROWS].index("labelled-mask-logits")
    setting = dataclasses.replace(SETTING, drift_steps=2)
    result = train.run_row(index, setting)
    assert result["drift_steps"] == 2 and result["drift_heap_growth_mb"] is not None
    assert len(result["losses"]) == setting.warmup + setting.steps
    assert "--drift-steps=2" in e2e._setting_argv(setting) and "--drift-steps" not in " ".join(e2e._setting_argv(SETTING))


def test_an_inference_row_reports_its_changing_batch_calls() -> None:
    """bench infer --drift-steps: the calls on new images run after the measured ones and do not change the
    reported detections of the measured batch."""
    index = [row.name for row in infer.ROWS].index("labelled-mask-logits")
    plain = infer.run_row(index, SETTING)
    result = infer.run_row(index, dataclasses.replace(SETTING, drift_steps=2))
    assert "drift_steps" not in plain
    assert result["drift_steps"] == 2 and result["drift_heap_growth_mb"] is not None
    assert result["detections_per_call"] == plain["detections_per_call"] > 0


@pytest.mark.parametrize(("row", "peak_first"), [("torchvision-fp32", False), ("retain-cpu-heap", True)])
def test_a_row_that_keeps_its_heap_measures_its_peak_before_the_instrumented_steps(
        row: str, peak_first: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept heap is measured in the state the timed steps left: the FLOP count and the profiled step allocate
    in their own patterns and grew an R50 row's kept heap by ~50 MB. A row whose heap is released and whose
    allocator is pinned for the peak step measures it after them (the pin would change their allocations).
    (``bench infer`` has no row that keeps its heap.)"""
    calls: list[str] = []
    count, peak_of, breakdown = train.count_flops, e2e_rows.PeakMemory.peak_of, train.time_breakdown

    def counting(fn: Any) -> int:
        calls.append(f"flops, heap kept: {retains_freed_memory()}")
        return count(fn)

    def measuring(self: e2e_rows.PeakMemory, fn: Any) -> dict[str, float]:
        calls.append(f"peak, heap kept: {retains_freed_memory()}")
        return peak_of(self, fn)

    def profiling(*args: Any, **kwargs: Any) -> Any:
        calls.append(f"profile, heap kept: {retains_freed_memory()}")
        return breakdown(*args, **kwargs)

    monkeypatch.setattr(train, "count_flops", counting)
    monkeypatch.setattr(e2e_rows.PeakMemory, "peak_of", measuring)
    monkeypatch.setattr(train, "time_breakdown", profiling)
    result = train.run_row([r.name for r in train.ROWS].index(row), SETTING)
    assert not retains_freed_memory()  # the row's teardown restored glibc's policy
    instrumented = [f"flops, heap kept: {peak_first}", f"profile, heap kept: {peak_first}"]
    peak = [f"peak, heap kept: {peak_first}"]
    assert calls == (peak + instrumented if peak_first else instrumented + peak)
    assert result["peak_memory_mb"] > 0

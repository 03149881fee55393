"""What makes a bench figure trustworthy, without running a bench: the run order, the aggregation of repeats,
the roofline arithmetic and its peak cache, FLOP counting, the shared state's cache key and the input batch.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import cpuinfo_text
from lightning.fabric.utilities.data import AttributeDict

from lit_amp_det.bench import breakdown, e2e, e2e_report, e2e_rows, precision, repeats, roofline, state
from lit_amp_det.bench.common import cpu_name, shapes_batch, weights_sha256

SETTING = e2e_rows.Setting(device="cpu", model="maskrcnn_tiny", batch=2, height=64, width=64, num_classes=7,
                           steps=1, warmup=0, compile_warmup=0)


def test_run_order_interleaves_rows_round_by_round() -> None:
    assert repeats.run_order(3, 2) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert repeats.run_order(1, 3) == [(0, 0), (1, 0), (2, 0)]


def test_seeded_run_order_shuffles_every_round_reproducibly() -> None:
    order = repeats.run_order(5, 4, seed=0)
    rounds = [[row for r, row in order if r == round_] for round_ in range(4)]
    assert [r for r, _ in order] == sorted(r for r, _ in order)  # round after round
    assert all(sorted(rows) == [0, 1, 2, 3, 4] for rows in rounds)
    assert len({tuple(rows) for rows in rounds}) > 1  # not one permutation repeated
    assert repeats.run_order(5, 4, seed=0) == order and repeats.run_order(5, 4, seed=1) != order


@pytest.mark.parametrize(("rows", "count"), [(0, 1), (2, 0)])
def test_run_order_rejects_empty_runs(rows: int, count: int) -> None:
    with pytest.raises(ValueError, match=f"rows={rows}, repeats={count}"):
        repeats.run_order(rows, count)


def test_run_repeats_records_positions_and_stops_a_failed_row() -> None:
    calls: list[tuple[int, int, int]] = []

    def run(row: int, round_: int, position: int) -> dict[str, Any]:
        calls.append((row, round_, position))
        return {"status": "failed" if row == 1 else "ok", "row": row}

    results = repeats.run_repeats(repeats.run_order(3, 2), run, 3)
    assert calls == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (0, 1, 3), (2, 1, 5)]  # row 1 not run again
    assert [r["position"] for r in results[0]] == [0, 3] and [r["round"] for r in results[2]] == [0, 1]
    assert len(results[1]) == 1 and results[1][0]["status"] == "failed"


def _repeat(times: list[float], **extra: Any) -> dict[str, Any]:
    return {**e2e_rows.summarise([t / 1000 for t in times]), "status": "ok", "switches": {"x": 1}, **extra}


def test_aggregate_is_the_median_of_repeat_medians() -> None:
    runs = [_repeat([100, 110, 120], peak_memory_mb=10.0, warmup_steps=3, label="a"),
            _repeat([200, 90, 95], peak_memory_mb=30.0, warmup_steps=3, label="b"),
            _repeat([105, 106, 300], peak_memory_mb=20.0, warmup_steps=3, label="c")]
    row = repeats.aggregate(runs, ["step"])
    assert [round(m, 6) for m in row["step_ms_repeat_medians"]] == [110, 95, 106]
    assert row["step_ms_median"] == pytest.approx(106)  # not the pooled median (106 too here, but of 9 steps)
    assert row["step_ms_repeat_min"] == pytest.approx(95) and row["step_ms_repeat_max"] == pytest.approx(110)
    assert row["step_ms_repeat_spread"] == pytest.approx(15 / 106)
    pooled = sorted([100, 110, 120, 200, 90, 95, 105, 106, 300])
    assert sorted(row["step_ms_all"]) == pytest.approx(pooled)
    q1, _, q3 = statistics.quantiles(pooled, n=4, method="inclusive")
    assert row["step_ms_q1"] == pytest.approx(q1) and row["step_ms_iqr"] == pytest.approx(q3 - q1)
    assert row["step_ms_min"] == pytest.approx(90) and row["step_ms_max"] == pytest.approx(300)
    assert row["peak_memory_mb"] == 20.0 and row["warmup_steps"] == 3 and row["label"] == "a"
    assert row["repeats"] == 3 and row["repeat_results"] == runs and "round" not in row


def test_aggregate_of_a_row_with_a_failed_repeat_is_failed() -> None:
    failed = {"status": "failed", "error": "boom", "returncode": 1}
    row = repeats.aggregate([_repeat([100.0]), failed], ["step"])
    assert row["status"] == "failed" and row["error"] == "boom"
    assert row["repeats"] == 2 and row["repeats_ok"] == 1


def test_finish_row_derives_throughput_and_roofline_from_the_median() -> None:
    peaks = {"peaks": {"fp32": {"gflops": 200.0}, "bf16": {"gflops": 800.0}}}
    row = e2e.finish_row({"status": "ok", "step_ms_median": 250.0, "gflop_per_step": 40.0, "compute_dtype": "bf16"},
                         4, "step", peaks)
    assert row["images_per_s"] == 16.0 and row["achieved_gflops"] == 160.0
    assert row["peak_gflops"] == 800.0 and row["peak_fraction"] == 0.2
    assert roofline.roofline(None, 250.0, "fp16", peaks["peaks"])["peak_fraction"] is None
    assert "model_peak_fraction" not in row and e2e_report.roofline_text(row) == "160 (20 % bf16)"
    same = e2e.finish_row({"status": "ok", "step_ms_median": 250.0, "gflop_per_step": 40.0, "compute_dtype": "bf16",
                           "model_gflop_per_step": 40.0}, 4, "step", peaks)
    assert "model_peak_fraction" not in same


def test_a_row_with_fewer_flops_than_its_model_also_reports_model_flops_utilisation() -> None:
    """Winograd rows execute fewer FLOPs than the model defines: both rates are reported, each against the peak."""
    peaks = {"peaks": {"bf16": {"gflops": 800.0}}}
    row = e2e.finish_row({"status": "ok", "step_ms_median": 250.0, "gflop_per_step": 30.0, "compute_dtype": "bf16",
                          "model_gflop_per_step": 40.0}, 4, "step", peaks)
    assert row["achieved_gflops"] == 120.0 and row["peak_fraction"] == 0.15
    assert row["model_achieved_gflops"] == 160.0 and row["model_peak_fraction"] == 0.2
    assert e2e_report.roofline_text(row) == "120 (15 % bf16); model FLOPs 160 (20 %)"


@pytest.mark.parametrize(("text", "dtype"), [("32-true", "fp32"), ("32", "fp32"), ("bf16-mixed", "bf16"),
                                             ("16-mixed", "fp16"), ("bf16-true", "bf16")])
def test_compute_dtype(text: str, dtype: str) -> None:
    assert roofline.compute_dtype(text) == dtype


def test_compute_dtype_names_the_accepted_values() -> None:
    with pytest.raises(ValueError, match="'64-true'.*32-true, bf16-mixed or 16-mixed"):
        roofline.compute_dtype("64-true")


def test_count_flops_counts_forward_and_backward_matmuls() -> None:
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(8, 64)
    assert roofline.count_flops(lambda: layer(x)) == 2 * 8 * 64 * 32
    assert roofline.count_flops(lambda: layer(x).sum().backward()) == 2 * 2 * 8 * 64 * 32  # + grad of the weight
    x.requires_grad_(True)
    assert roofline.count_flops(lambda: layer(x).sum().backward()) == 3 * 2 * 8 * 64 * 32


def test_count_flops_counts_in_place_products_like_their_out_of_place_ops() -> None:
    """FlopCounterMode alone counts ``baddbmm_`` (the Winograd weight gradient's running sum) as 0 FLOPs."""
    a, b = torch.randn(4, 8, 16), torch.randn(4, 16, 32)
    total, matrix = torch.zeros(4, 8, 32), torch.zeros(8, 32)
    products = 2 * 4 * 8 * 16 * 32
    assert roofline.count_flops(lambda: torch.baddbmm(total, a, b)) == products
    assert roofline.count_flops(lambda: total.baddbmm_(a, b)) == products
    assert roofline.count_flops(lambda: matrix.addmm_(a[0], b[0])) == products // 4
    assert set(roofline.IN_PLACE_PRODUCTS) == {"addmm_", "baddbmm_"}
    assert len(roofline.in_place_flop_formulas()) == 2  # each found its formula in this torch


def test_count_flops_counts_the_winograd_weight_gradient() -> None:
    from lit_amp_det.models.winograd_conv import _weight_gradient
    from lit_amp_det.ops.winograd import tile_count

    n, c_in, c_out, size = 2, 8, 12, 6
    x = torch.randn(n, c_in, size, size).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(n, c_out, size, size).contiguous(memory_format=torch.channels_last)
    weight = torch.randn(c_out, c_in, 3, 3)
    tiles = tile_count(n, size, size)
    products = 2 * 16 * c_out * tiles * c_in  # the 16 [C_out, T] @ [T, C_in] products, summed by baddbmm_
    # the back transform A'^T s A', like the tile transforms, is a memory-bound kernel of the extension: not counted
    assert roofline.count_flops(lambda: _weight_gradient(x, grad, weight)) == products


def test_peaks_are_measured_once_per_machine_and_dtype_then_reused(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roofline, "busy_cpus", lambda seconds=1.0: 0.1)  # a quiet machine
    first = roofline.device_peaks("cpu", ["fp32"], tmp_path, target_s=0.005)
    path = tmp_path / roofline.PEAKS_FILE
    written, stamp = path.read_bytes(), path.stat().st_mtime_ns
    assert first["measured"] == ["fp32"] and first["cached"] == [] and first["file"] == str(path)
    peak = first["peaks"]["fp32"]
    assert peak["matmul_gflops"] == pytest.approx(2 * peak["n"] ** 3 / peak["best_s"] / 1e9) and peak["runs"] == 3
    conv_flops = 2 * 2 * 256 * 256 * 9 * 64 * 64 * peak["conv_calls"]
    assert peak["conv_gflops"] == pytest.approx(conv_flops / peak["conv_best_s"] / 1e9)
    assert peak["gflops"] == max(peak["matmul_gflops"], peak["conv_gflops"])
    assert json.loads(written) == {roofline.machine_key("cpu"): {"fp32": peak}}
    assert str(torch.get_num_threads()) in first["key"] and torch.__version__ in first["key"]

    def no_measuring(device: str, dtype: str, target_s: float = 0.5) -> dict[str, Any]:
        if dtype == "fp32":
            raise AssertionError("the cached fp32 peak was measured again")
        return {"gflops": 123.0, "n": 256, "best_s": 1.0, "runs": 3, "tf32": False, "measured_at": "now",
                "matmul_gflops": 123.0, "conv_gflops": 100.0, "conv_calls": 1}

    monkeypatch.setattr(roofline, "measure_peak", no_measuring)
    again = roofline.device_peaks("cpu", ["fp32"], tmp_path)
    assert again["peaks"] == first["peaks"] and again["measured"] == [] and again["cached"] == ["fp32"]
    assert path.read_bytes() == written and path.stat().st_mtime_ns == stamp  # not even rewritten
    more = roofline.device_peaks("cpu", ["fp32", "bf16"], tmp_path)
    assert more["measured"] == ["bf16"] and more["peaks"]["fp32"] == peak and more["peaks"]["bf16"]["gflops"] == 123.0
    assert json.loads(path.read_text())[first["key"]] == {"fp32": peak, "bf16": more["peaks"]["bf16"]}
    table = json.loads(path.read_text())  # a cache written before the convolution probe: measured again
    table[first["key"]]["fp32"] = {k: v for k, v in peak.items() if not k.startswith("conv_")}
    path.write_text(json.dumps(table))
    monkeypatch.setattr(roofline, "measure_peak", lambda device, dtype, target_s=0.5: {**peak, "gflops": 1.0})
    assert roofline.device_peaks("cpu", ["fp32"], tmp_path)["measured"] == ["fp32"]


def test_state_key_holds_what_the_state_depends_on(tmp_path: Path) -> None:
    key = state.state_key(SETTING, 200)
    assert key["model"]["backbone"]["name"] == "resnet10" and key["model"]["optimizer"]["_target_"] == "torch.optim.SGD"
    assert key["torch"] == torch.__version__ and key["steps"] == 200 and key["format"] == state.FORMAT
    path, record = state.state_paths(key, tmp_path)
    assert path.parent == tmp_path / "bench_state" and path.suffix == ".pt" and record.suffix == ".json"
    for other in (state.state_key(SETTING, 100), state.state_key(dataclasses.replace(SETTING, height=96), 200),
                  state.state_key(dataclasses.replace(SETTING, num_classes=4), 200),
                  state.state_key(dataclasses.replace(SETTING, batch=4), 200)):
        assert state.state_paths(other, tmp_path)[0] != path
    # the state does not depend on where it is loaded from, nor on the row's switches
    assert state.state_key(dataclasses.replace(SETTING, checkpoint="/x.pt", lr=0.1), 200) == key


def test_the_r50_state_scales_its_recipe_lr_to_the_bench_batch(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The R50-FPN's lr 0.02 is for 16 images: its state trains at 0.02 x batch / 16 (the light models' lr as
    configured), and the reference batch is part of the state's key."""
    r50 = dataclasses.replace(SETTING, model="maskrcnn_r50_fpn")
    assert state.state_key(r50, 200)["model"]["reference_batch"] == 16
    assert state.state_key(SETTING, 200)["model"]["reference_batch"] is None
    built_lrs: list[float] = []
    from lit_amp_det import optim

    real_build = optim.build_optimizer

    def recording_build(config, params):
        built_lrs.append(float(config["lr"]))
        return real_build(config, params)

    monkeypatch.setattr(optim, "build_optimizer", recording_build)
    monkeypatch.setattr(state, "train_step", lambda *args: torch.tensor(1.0))  # the lr, not the maths, is tested
    for setting, module_reference in ((SETTING, None), (r50, 16)):
        module = SimpleNamespace(hparams=AttributeDict(optimizer={"_target_": "torch.optim.SGD", "lr": 0.02},
                                                       reference_batch=module_reference, scheduler=None),
                                 parameters=lambda: [torch.nn.Parameter(torch.zeros(1))], train=lambda: None)
        monkeypatch.setattr(state, "shapes_batch", lambda *args: ([torch.zeros(3, 8, 8)], [{}]))
        losses, final_lr = state._train(setting, 1, module, None, io.StringIO())
        assert losses == [1.0]
    assert built_lrs == [0.02, pytest.approx(0.02 * 2 / 16)]


def test_state_key_leaves_out_switches_added_later_at_their_first_row_value() -> None:
    """``model.winograd_output_tile``, ``optim.optimizer.memory_order_views``, ``model.winograd_weight_tile_cache``
    and ``model.binary_mask_paste`` came after the cached states: at the first row's values they are not in the key,
    so the key (and the cached state's file name) is what it was before the switches existed."""
    cfg_model = state.compose(state._state_overrides(SETTING)).model
    assert cfg_model.winograd_output_tile == 2 and cfg_model.optimizer.memory_order_views is True
    assert cfg_model.winograd_weight_tile_cache is False and cfg_model.binary_mask_paste is False
    assert state.KEY_OMITS_AT == {"winograd_output_tile": 2, "optimizer.memory_order_views": True,
                                  "winograd_weight_tile_cache": False, "binary_mask_paste": False}
    key = state.state_key(SETTING, 200)["model"]
    assert "winograd_output_tile" not in key and "memory_order_views" not in key["optimizer"]
    assert "winograd_weight_tile_cache" not in key and "binary_mask_paste" not in key
    assert key["optimizer"]["fused"] is None  # why the views change nothing the state's training computes


def test_shapes_batch_holds_the_visible_shapes_with_tight_boxes() -> None:
    images, targets = shapes_batch("val", range(3), 48, 80, 3, "cpu")
    for image, target in zip(images, targets, strict=True):
        assert image.dtype == torch.uint8 and image.shape == (3, 48, 80)
        masks, boxes = target["masks"], target["boxes"]
        assert masks.shape[1:] == (48, 80) and len(masks) == len(boxes) == len(target["labels"])
        assert set(target["labels"].tolist()) <= {1, 2}  # 6 shape classes folded onto 2 foreground classes
        for mask, box in zip(masks, boxes, strict=True):
            ys, xs = mask.nonzero(as_tuple=True)
            assert box.tolist() == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
    assert sum(len(t["boxes"]) for t in targets) > 0
    again = shapes_batch("val", range(3), 48, 80, 3, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(images, again[0], strict=True))


def test_weights_hash_sees_values_not_layout() -> None:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3)
    digest = weights_sha256(conv)
    assert weights_sha256(conv.to(memory_format=torch.channels_last)) == digest
    with torch.no_grad():
        conv.weight[0, 0, 0, 0] += 1e-6
    assert weights_sha256(conv) != digest


def test_precision_row_reports_roofline_and_state_keys() -> None:
    row = precision.run_row("bf16-mixed", "plain", SETTING, fp16_on_cpu=False)
    assert row["precision"] == "bf16-mixed" and row["compute_dtype"] == "bf16" and row["gflop_per_step"] > 0
    assert row["lr"] == precision.RANDOM_STATE_LR and len(row["weights_sha256"]) == 64
    assert row["step_ms_spread"] == row["step_ms_max"] - row["step_ms_min"] and len(row["step_ms_all"]) == 1


def test_peaks_measured_under_load_are_used_but_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(roofline, "busy_cpus", lambda seconds=1.0: 1.6)
    monkeypatch.setattr(roofline, "measure_peak", lambda device, dtype, target_s=0.5: {
        "gflops": 90.0, "n": 256, "best_s": 1.0, "runs": 3, "tf32": False, "measured_at": "now"})
    loaded = roofline.device_peaks("cpu", ["fp32"], tmp_path)
    assert not (tmp_path / roofline.PEAKS_FILE).exists()
    assert loaded["measured"] == ["fp32"] and loaded["busy_cpus"] == 1.6
    assert loaded["peaks"]["fp32"]["gflops"] == 90.0 and loaded["peaks"]["fp32"]["busy_cpus"] == 1.6
    assert "kept 1.6 CPUs busy" in capsys.readouterr().err
    assert "1.6 CPUs busy with other work: a low peak, not cached" in e2e_report.peaks_line(loaded)


def test_peaks_of_zen4_and_zen5_hosts_are_kept_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = set()
    for family, model in ((25, 17), (26, 2)):
        text = cpuinfo_text("AuthenticAMD", family, model)
        monkeypatch.setattr(roofline, "cpu_name", lambda text=text: cpu_name(text))
        keys.add(roofline.machine_key("cpu"))
    assert len(keys) == 2


def test_busy_cpus_reads_the_machine() -> None:
    busy = roofline.busy_cpus(0.2)
    if sys.platform.startswith("linux"):  # /proc/stat is there: a figure, not None
        assert busy is not None
    assert busy is None or 0.0 <= busy <= os.cpu_count() + 0.01


def test_is_flop_op_bins_matmuls_and_convolutions() -> None:
    for name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::baddbmm_", "aten::conv2d",
                 "aten::conv_transpose2d", "aten::convolution",
                 "aten::convolution_backward", "aten::mkldnn_convolution", "aten::cudnn_convolution",
                 "mkldnn::_convolution_pointwise", "mkldnn::_linear_pointwise"):
        assert breakdown.is_flop_op(name), name
    for name in ("aten::copy_", "aten::_to_copy", "aten::add_", "lit_amp_det::roi_align", "aten::native_batch_norm",
                 "aten::_convert_indices_from_coo_to_csr", "Optimizer.step#SGD.step"):
        assert not breakdown.is_flop_op(name), name


def test_display_names_drop_aten_and_name_the_autograd_wrapper_as_the_forward() -> None:
    assert breakdown.display_name("aten::copy_") == "copy_"
    assert breakdown.display_name("lit_amp_det::_multi_level_roi_align_backward") == (
        "lit_amp_det::_multi_level_roi_align_backward")
    assert breakdown.display_name("GeneratedBackwardFor_lit_amp_det_multi_level_roi_align_default") == (
        "lit_amp_det_multi_level_roi_align_default forward")


def test_time_breakdown_splits_a_step_into_flop_ops_and_the_rest() -> None:
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    big = torch.randn(2_000_000)

    def step() -> None:
        (a @ b).sum()
        big.clone().mul_(2)

    gflop = 2 * 256**3 / 1e9
    result = breakdown.time_breakdown(step, "cpu", gflop)
    assert 0 < result["flop_ops_ms"] and 0 < result["other_ops_ms"]
    assert result["flop_ops_ms"] + result["other_ops_ms"] <= result["profiled_step_ms"] * 1.05
    assert result["flop_ops_share"] == pytest.approx(result["flop_ops_ms"] / result["profiled_step_ms"])
    assert result["flop_ops_gflops"] == pytest.approx(gflop / (result["flop_ops_ms"] / 1000))
    assert {"aten::clone", "aten::mul_"} & set(result["top_other_ops"]) and "aten::mm" not in result["top_other_ops"]
    row = {"status": "ok", "label": "a row", "compute_dtype": "fp32", **result}
    lines = breakdown.breakdown_lines([{"status": "failed", "label": "broken"}, row], {"fp32": {"gflops": 100.0}})
    assert lines[-1].startswith("| 2 | a row | ") and "broken" not in "\n".join(lines)
    assert f"{result['flop_ops_gflops']:.0f} ({result['flop_ops_gflops']:.0f} %)" in lines[-1]
    assert breakdown.breakdown_lines([{"status": "ok", "label": "no profile"}], {}) == []

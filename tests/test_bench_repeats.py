"""What makes a bench figure trustworthy, without running a bench: the run order, the aggregation of repeats,
the shared state's cache key and recipe, the timed batch and the weights hash.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from lit_amp_det.bench import repeats, state
from lit_amp_det.bench.measure import shapes_batch, summarise, weights_sha256
from lit_amp_det.bench.rows import Setting, compose

SETTING = Setting(
    device="cpu",
    model="maskrcnn_tiny",
    batch=2,
    height=64,
    width=64,
    num_classes=7,
    steps=1,
    warmup=0,
    compile_warmup=0,
)


def test_run_order_rotates_the_rows_every_round() -> None:
    """Round r starts at row r: no row always runs first (or last)."""
    assert repeats.run_order(3, 4) == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 1),
        (1, 2),
        (1, 0),
        (2, 2),
        (2, 0),
        (2, 1),
        (3, 0),
        (3, 1),
        (3, 2),
    ]
    assert repeats.run_order(1, 3) == [(0, 0), (1, 0), (2, 0)]


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
    assert calls == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 0, 2),
        (2, 1, 4),
        (0, 1, 5),
    ]  # row 1 not run again (position 3)
    assert [r["position"] for r in results[0]] == [0, 5] and [r["round"] for r in results[2]] == [0, 1]
    assert len(results[1]) == 1 and results[1][0]["status"] == "failed"


def _repeat(times: list[float], **extra: Any) -> dict[str, Any]:
    return {**summarise([t / 1000 for t in times], "step"), "status": "ok", "round": 0, **extra}


def test_aggregate_is_the_median_of_repeat_medians() -> None:
    runs = [
        _repeat([100, 110, 120], peak_memory_mb=10.0, warmup_steps=3, label="a"),
        _repeat([200, 90, 95], peak_memory_mb=30.0, warmup_steps=3, label="b"),
        _repeat([105, 106, 300], peak_memory_mb=20.0, warmup_steps=3, label="c"),
    ]
    row = repeats.aggregate(runs, ["step"])
    assert row["step_ms_repeat_medians"] == pytest.approx([110, 95, 106])
    assert row["step_ms_median"] == pytest.approx(106)  # not the pooled median of the 9 steps
    assert row["step_ms_repeat_spread"] == pytest.approx(15 / 106)
    assert sorted(row["step_ms_all"]) == pytest.approx(sorted([100, 110, 120, 200, 90, 95, 105, 106, 300]))
    assert row["peak_memory_mb"] == 20.0 and row["label"] == "a"
    assert row["warmup_steps"] == 3 and isinstance(
        row["warmup_steps"], int
    )  # equal in every repeat: kept as is
    assert row["repeats"] == 3 and row["repeat_results"] == runs and "round" not in row


def test_aggregate_of_a_row_with_a_failed_repeat_is_failed() -> None:
    failed = {"status": "failed", "error": "boom", "returncode": 1}
    row = repeats.aggregate([_repeat([100.0]), failed], ["step"])
    assert row["status"] == "failed" and row["error"] == "boom" and row["repeats"] == 2


def test_summarise_keeps_every_time_in_ms() -> None:
    stats = summarise([0.3, 0.1, 0.2], "latency")
    assert stats["latency_ms_median"] == pytest.approx(200)
    assert stats["latency_ms_all"] == pytest.approx([300, 100, 200])
    assert statistics.median(stats["latency_ms_all"]) == stats["latency_ms_median"]


def test_state_key_holds_what_the_state_depends_on(tmp_path: Path) -> None:
    key = state.state_key(SETTING, 200)
    model = key["model"]
    assert (
        model["backbone"]["name"] == "resnet10"
        and model["optim"]["optimizer"]["_target_"] == "torch.optim.SGD"
    )
    assert (
        model["speedups"] == {} and model["weights"] is None
    )  # torchvision's model, from its initialisation
    assert key["torch"] == torch.__version__ and key["steps"] == 200 and key["format"] == state.FORMAT
    path, record = state.state_paths(key, tmp_path)
    assert path.parent == tmp_path / "bench_state" and path.suffix == ".pt" and record.suffix == ".json"
    for other in (
        state.state_key(SETTING, 100),
        state.state_key(dataclasses.replace(SETTING, height=96), 200),
        state.state_key(dataclasses.replace(SETTING, num_classes=4), 200),
        state.state_key(dataclasses.replace(SETTING, batch=4), 200),
    ):
        assert state.state_paths(other, tmp_path)[0] != path
    # the state depends neither on where it is loaded from nor on the rows' switches
    assert state.state_key(dataclasses.replace(SETTING, weights="/x.pt", lr=0.1, half="bf16"), 200) == key


def test_the_r50_state_trains_at_its_recipe_lr_scaled_to_the_bench_batch() -> None:
    """The R50-FPN's lr 0.02 is for 16 images: its state trains at 0.02 x batch / 16; the light models' lr is
    used as configured.
    """
    r50 = compose(state.state_overrides(dataclasses.replace(SETTING, model="maskrcnn_r50_fpn")))
    tiny = compose(state.state_overrides(SETTING))
    assert r50.optim.optimizer.lr == pytest.approx(0.02 * 2 / 16) and tiny.optim.optimizer.lr == 0.02
    assert tiny.trainer.precision == "32-true" and tiny.speedups == {} and not tiny.callbacks


def test_shapes_batch_holds_the_visible_shapes_with_tight_boxes() -> None:
    images, targets = shapes_batch("val", range(3), 48, 80, 3)
    for index, (image, target) in enumerate(zip(images, targets, strict=True)):
        assert image.dtype == torch.uint8 and image.shape == (3, 48, 80) and int(target["image_id"]) == index
        masks, boxes = target["masks"], target["boxes"]
        assert masks.shape[1:] == (48, 80) and len(masks) == len(boxes) == len(target["labels"])
        assert set(target["labels"].tolist()) <= {1, 2}  # 6 shape classes folded onto 2 foreground classes
        for mask, box in zip(masks, boxes, strict=True):
            ys, xs = mask.nonzero(as_tuple=True)
            assert box.tolist() == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
    assert sum(len(t["boxes"]) for t in targets) > 0
    again = shapes_batch("val", range(3), 48, 80, 3)
    assert all(torch.equal(a, b) for a, b in zip(images, again[0], strict=True))


def test_weights_hash_sees_values_not_layout() -> None:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3)
    digest = weights_sha256(conv)
    assert weights_sha256(conv.to(memory_format=torch.channels_last)) == digest
    with torch.no_grad():
        conv.weight[0, 0, 0, 0] += 1e-6
    assert weights_sha256(conv) != digest

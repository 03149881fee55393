"""``bench ops``: the groups it times, here the Winograd group (the fp32 A/B on this CPU) and the argument errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lit_amp_det.bench import ops as bench_ops
from lit_amp_det.ops import extension_available
from lit_amp_det.precision.hardware import cpu_computes_bf16_natively

needs_ext = pytest.mark.skipif(not extension_available(), reason="needs the compiled extension (make ext)")


@needs_ext
def test_winograd_group_times_each_layer_against_conv2d(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """One row per layer and dtype (bf16 only where the CPU computes it natively), both sides timed, in the table
    and the JSON. Two of the layers, so that the test stays fast on 2 cores."""
    layers = bench_ops.WINOGRAD_LAYERS[2:4]
    monkeypatch.setattr(bench_ops, "WINOGRAD_LAYERS", layers)
    out = tmp_path / "ops.json"
    bench_ops.main(["--device=cpu", "--only=winograd", "--repeats=1", "--warmup=0", f"--json={out}"])
    rows = json.loads(out.read_text())["rows"]
    dtypes = ["float32", *(["bfloat16"] if cpu_computes_bf16_natively() else [])]
    assert [(r["size"].split(":")[0], r["dtype"].split()[0]) for r in rows] == [
        (name, dtype) for name, *_ in layers for dtype in dtypes]
    assert all(r["op"] == "winograd conv3x3 fwd+bwd" and r["ours_ms"] > 0 and r["torchvision_ms"] > 0
               and r["speedup"] > 0 for r in rows)
    assert "ResNet-18 layer1, 224 px b4: 4x64x56x56, 64 -> 64" in capsys.readouterr().out


@needs_ext
def test_winograd_4x4_group_times_f4_against_f2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--only winograd_4x4``: one fp32 row per layer, F(4x4) tiles against F(2x2) tiles, both sides timed."""
    layers = bench_ops.WINOGRAD_LAYERS[2:4]
    monkeypatch.setattr(bench_ops, "WINOGRAD_LAYERS", layers)
    out = tmp_path / "ops.json"
    bench_ops.main(["--device=cpu", "--only=winograd_4x4", "--repeats=1", "--warmup=0", f"--json={out}"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["size"].split(":")[0] for r in rows] == [name for name, *_ in layers]
    assert all(r["dtype"] == "float32 channels_last, F(4x4) vs F(2x2)" and r["ours_ms"] > 0
               and r["torchvision_ms"] > 0 for r in rows)


@needs_ext
def test_winograd_weights_group_times_the_kernels_against_the_same_matmuls(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``--only winograd_weights``: per channel count and tile size a weight-tiles row and a weight-gradient row, both
    sides timed; and both sides of every row compute the same values (the A/B times the same work)."""
    monkeypatch.setattr(bench_ops, "WINOGRAD_LAYERS", bench_ops.WINOGRAD_LAYERS[2:4])  # 64 and 128 channels
    cases = bench_ops._winograd_weight_cases("cpu")
    assert [(name, size) for name, size, *_ in cases] == [
        (op, f"{c} -> {c} channels, F({m}x{m})") for c in (64, 128) for m in (2, 4)
        for op in ("winograd weight tiles", "winograd weight gradient")]
    for _, _, _, ours, theirs in cases:
        mine, matmul = ours(), theirs()
        assert mine.shape == matmul.shape
        torch.testing.assert_close(mine, matmul, atol=1e-5 * matmul.abs().max().item(), rtol=1e-5)
    out = tmp_path / "ops.json"
    bench_ops.main(["--device=cpu", "--only=winograd_weights", "--repeats=1", "--warmup=0", f"--json={out}"])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8 and all(r["dtype"] == "float32 channels_last weight (vs matmul)" and r["ours_ms"] > 0
                                  and r["torchvision_ms"] > 0 for r in rows)
    assert bench_ops._winograd_weight_cases("cuda") == []


def test_unknown_group_is_refused() -> None:
    with pytest.raises(SystemExit, match=r"--only: unknown group\(s\) \['winnograd'\]"):
        bench_ops.main(["--device=cpu", "--only=winnograd"])


def test_winograd_size_grid_covers_the_rule_boundaries() -> None:
    """The grid spans the fp32 rules' boundaries: 64 and 128 channels, 64 tiles (the floor), 196 and 256 tiles (below
    and at F4_MIN_TILES), ResNet-18's real maps at 224 px (7x7, 14x14, 28x28), and sizes on both sides of each rule."""
    from lit_amp_det.models.winograd_conv import F4_MIN_TILES, winograd_pays
    from lit_amp_det.ops.winograd import tile_count

    grid = bench_ops._winograd_grid()
    tiles = {tile_count(n, h, w) for _, n, _, h, w in grid}
    channels = {c for _, _, c, _, _ in grid}
    assert tiles == {64, 128, 196, 256, 784, 4096} and channels == {32, 64, 128, 256, 512}
    assert {h for *_, h, _ in grid} >= {7, 14, 28}
    verdicts = {winograd_pays(torch.float32, c, tile_count(n, h, w)) for _, n, c, h, w in grid}
    assert verdicts == {True, False}
    assert {tile_count(n, h, w) >= F4_MIN_TILES for _, n, _, h, w in grid} == {True, False}
    assert all(name == f"{c} channels, {tile_count(n, h, h)} tiles" for name, n, c, h, _ in grid)


@needs_ext
def test_winograd_4x4_sizes_group_runs_the_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--only winograd_4x4_sizes``: F(4x4) against F(2x2) on every grid layer (here two small ones)."""
    monkeypatch.setattr(bench_ops, "_winograd_grid", lambda: [("64 channels, 64 tiles", 4, 64, 7, 7),
                                                              ("64 channels, 256 tiles", 1, 64, 32, 32)])
    out = tmp_path / "ops.json"
    bench_ops.main(["--device=cpu", "--only=winograd_4x4_sizes", "--repeats=1", "--warmup=0", f"--json={out}"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["size"] for r in rows] == ["64 channels, 64 tiles: 4x64x7x7, 64 -> 64",
                                         "64 channels, 256 tiles: 1x64x32x32, 64 -> 64"]
    assert all(r["dtype"] == "float32 channels_last, F(4x4) vs F(2x2)" and r["ours_ms"] > 0 for r in rows)

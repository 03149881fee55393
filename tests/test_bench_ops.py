"""``bench ops``: each group runs both sides on the same inputs and reports them; bad groups are refused.
Nothing is timed for its own sake: one call per side.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lit_amp_det.bench import ops as bench_ops
from lit_amp_det.ops import extension_available

needs_ext = pytest.mark.skipif(not extension_available(), reason="needs the compiled extension (make ext)")


@needs_ext
def test_nms_and_iou_groups_compare_each_op_with_torchvision(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "ops.json"
    bench_ops.main(["--device=cpu", "--only=nms,iou", "--repeats=1", "--warmup=0", f"--json={out}"])
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == [
        "nms rpn (max_output)",
        "batched_nms rpn (max_output)",
        "batched_nms det (max_output)",
        "nms full",
        "box_iou",
        "box_iou",
    ]
    assert all(r["ours_ms"] > 0 and r["torchvision_ms"] > 0 and r["repeats"] == 1 for r in rows)
    assert "| box_iou | 20 x 2000 (RoI matcher) | fp32 |" in capsys.readouterr().out


def test_both_sides_of_the_nms_and_iou_cases_agree() -> None:
    """Each case times the same work on both sides: equal results (ours stops NMS at the kept count)."""
    for name, _, _, ours, theirs in [*bench_ops._nms_cases("cpu"), *bench_ops._iou_cases("cpu")]:
        mine, reference = ours(), theirs()
        if name.startswith(("nms", "batched_nms")):
            assert torch.equal(mine.cpu(), reference.cpu()), name
        else:
            torch.testing.assert_close(mine, reference)


def test_unknown_group_is_refused() -> None:
    with pytest.raises(SystemExit, match=r"--only.*\['winograd'\]"):
        bench_ops.main(["--device=cpu", "--only=winograd"])

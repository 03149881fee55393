"""NMS, batched NMS and box IoU: parity with torchvision and the PyTorch reference, edge cases, compile."""

from __future__ import annotations

import pytest
import torch
import torchvision

import lit_amp_det.ops as ops
from lit_amp_det.ops import reference
from ops_inputs import DEVICES, distinct_scores, needs_extension, random_boxes

pytestmark = needs_extension

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _iou_precision(boxes):
    """The boxes as our kernels compare them: half and bfloat16 upcast exactly to fp32, fp64 kept."""
    return boxes.cpu().to(torch.float64 if boxes.dtype == torch.float64 else torch.float32)


def _tv_nms(boxes, scores, threshold):
    """torchvision's CPU NMS on the same values in the same IoU precision: the results (and tie order) we
    match.
    """
    boxes = _iou_precision(boxes)
    return torchvision.ops.nms(boxes, scores.cpu().to(boxes.dtype), threshold)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("clusters", [0, 20])
def test_nms_matches_torchvision_and_reference(device, dtype, clusters):
    boxes = random_boxes(3000, clusters=clusters).to(device, dtype)
    scores = distinct_scores(3000).to(device)
    expected = _tv_nms(boxes, scores, 0.5)
    got = ops.nms(boxes, scores, 0.5)
    assert got.dtype == torch.int64 and got.device.type == device
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(reference.nms(boxes, scores, 0.5).cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_output", [0, 1, 7, 2000, 100_000])
def test_nms_max_output_is_a_prefix_of_the_full_result(device, max_output):
    boxes = random_boxes(4000, clusters=50).to(device)
    scores = distinct_scores(4000).to(device)
    full = ops.nms(boxes, scores, 0.7)
    assert full.numel() > 7
    assert torch.equal(ops.nms(boxes, scores, 0.7, max_output=max_output), full[:max_output])


@pytest.mark.parametrize("device", DEVICES)
def test_nms_at_rpn_size_keeps_the_torchvision_top_k(device):
    """12000 proposals -> the 2000 best kept, as torchvision's nms followed by slicing."""
    boxes = random_boxes(12000, clusters=200).to(device)
    scores = distinct_scores(12000).to(device)
    got = ops.nms(boxes, scores, 0.7, max_output=2000)
    assert got.numel() == 2000
    assert torch.equal(got.cpu(), torchvision.ops.nms(boxes.cpu(), scores.cpu(), 0.7)[:2000])


@pytest.mark.parametrize("device", DEVICES)
def test_nms_tied_scores_keep_the_lower_index_first(device):
    boxes = random_boxes(500).to(device)
    scores = torch.randint(0, 5, (500,)).float().to(device)  # heavy ties
    assert torch.equal(ops.nms(boxes, scores, 0.3).cpu(), torchvision.ops.nms(boxes.cpu(), scores.cpu(), 0.3))
    assert torch.equal(
        reference.nms(boxes, scores, 0.3).cpu(), torchvision.ops.nms(boxes.cpu(), scores.cpu(), 0.3)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nms_iou_exactly_at_the_threshold_does_not_suppress(device, dtype):
    # IoU([0,0,2,1], [0,0,1,1]) = 1/2 exactly, and IoU([0,0,4,1], [0,0,3,1]) = 3/4 exactly
    boxes = torch.tensor(
        [[0, 0, 2, 1], [0, 0, 1, 1], [10, 0, 14, 1], [10, 0, 13, 1]], dtype=dtype, device=device
    )
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6], device=device)
    for threshold, kept in ((0.5, [0, 1, 2]), (0.75, [0, 1, 2, 3]), (0.4999, [0, 2]), (0.7499, [0, 1, 2])):
        assert ops.nms(boxes, scores, threshold).tolist() == kept, threshold
        assert reference.nms(boxes, scores, threshold).tolist() == kept, threshold


@pytest.mark.parametrize("device", DEVICES)
def test_nms_degenerate_boxes(device):
    boxes = torch.tensor(
        [
            [5, 5, 5, 5],
            [5, 5, 5, 5],
            [-50, -50, -10, -10],
            [-50, -50, -10, -12],
            [3, 3, 1, 1],
            [0, 0, 10, 10],
        ],
        dtype=torch.float32,
        device=device,
    )
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4], device=device)
    # zero-area boxes never suppress (IoU 0, not NaN); boxes outside the image behave like any other;
    # the inverted box [3, 3, 1, 1] overlaps nothing (its clamped intersections are empty)
    assert ops.nms(boxes, scores, 0.5).tolist() == [0, 1, 2, 4, 5]
    assert reference.nms(boxes, scores, 0.5).tolist() == [0, 1, 2, 4, 5]


@pytest.mark.parametrize("device", DEVICES)
def test_nms_empty_input(device):
    boxes = torch.empty(0, 4, device=device)
    scores = torch.empty(0, device=device)
    for result in (
        ops.nms(boxes, scores, 0.5),
        ops.nms(boxes, scores, 0.5, 10),
        ops.batched_nms(boxes, scores, torch.empty(0, dtype=torch.int64, device=device), 0.5),
    ):
        assert result.shape == (0,) and result.dtype == torch.int64


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("classes", [1, 5, 90])
def test_batched_nms_matches_torchvision(device, dtype, classes):
    boxes = random_boxes(4000, clusters=40).to(device, dtype)
    scores = distinct_scores(4000).to(device)
    idxs = torch.randint(classes, (4000,), generator=torch.Generator().manual_seed(3)).to(device)
    tv_boxes = _iou_precision(boxes)
    expected = torchvision.ops.batched_nms(tv_boxes, scores.cpu().to(tv_boxes.dtype), idxs.cpu(), 0.6)
    full = ops.batched_nms(boxes, scores, idxs, 0.6)
    assert torch.equal(full.cpu(), expected)
    assert torch.equal(reference.batched_nms(boxes, scores, idxs, 0.6).cpu(), expected)
    for k in (0, 1, 100, 2000):
        assert torch.equal(ops.batched_nms(boxes, scores, idxs, 0.6, max_output=k).cpu(), expected[:k])


@pytest.mark.parametrize("device", DEVICES)
def test_batched_nms_rpn_levels(device):
    """The RPN's call: 5 FPN levels of 2000 candidates, NMS per level, 2000 kept overall."""
    boxes = torch.cat(
        [random_boxes(2000, clusters=100, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    )
    scores = distinct_scores(10000).to(device)
    levels = torch.arange(5).repeat_interleave(2000).to(device)
    boxes = boxes.to(device)
    expected = torchvision.ops.batched_nms(boxes.cpu(), scores.cpu(), levels.cpu(), 0.7)[:2000]
    assert torch.equal(ops.batched_nms(boxes, scores, levels, 0.7, max_output=2000).cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_output", [-1, 0, 1, 50, 5000])
def test_batched_nms_padded_is_batched_nms_of_the_valid_boxes(device, dtype, max_output):
    boxes = random_boxes(3000, clusters=30).to(device, dtype)
    scores = distinct_scores(3000).to(device)
    idxs = torch.randint(4, (3000,), generator=torch.Generator().manual_seed(4)).to(device)
    valid = (torch.rand(3000, generator=torch.Generator().manual_seed(5)) > 0.4).to(device)
    members = torch.nonzero(valid).flatten()
    limit = 3000 if max_output < 0 else min(3000, max_output)
    expected = members[ops.batched_nms(boxes[members], scores[members], idxs[members], 0.6, limit)]
    for keep, count in (
        ops.batched_nms_padded(boxes, scores, idxs, 0.6, max_output, valid=valid),
        reference.batched_nms_padded(boxes, scores, idxs, 0.6, max_output, valid),
    ):
        assert keep.shape == (limit,) and keep.dtype == count.dtype == torch.int64 and count.shape == ()
        assert keep.device == count.device == boxes.device
        assert int(count) == expected.shape[0] and torch.equal(keep[: int(count)], expected)
        assert (keep[int(count) :] == -1).all()
    keep, count = ops.batched_nms_padded(boxes, scores, idxs, 0.6, max_output)  # no mask: every box
    assert torch.equal(keep[: int(count)], ops.batched_nms(boxes, scores, idxs, 0.6, limit))


@pytest.mark.parametrize("device", DEVICES)
def test_batched_nms_padded_empty_and_all_invalid(device):
    none = torch.zeros(0, 4, device=device)
    keep, count = ops.batched_nms_padded(none, none[:, 0], none[:, 0].long(), 0.5, 10)
    assert keep.shape == (0,) and int(count) == 0
    boxes, scores = random_boxes(20).to(device), distinct_scores(20).to(device)
    keep, count = ops.batched_nms_padded(
        boxes,
        scores,
        torch.zeros(20, dtype=torch.int64, device=device),
        0.5,
        8,
        valid=torch.zeros(20, dtype=torch.bool, device=device),
    )
    assert keep.tolist() == [-1] * 8 and int(count) == 0


def test_batched_nms_padded_rejects_a_bad_valid_mask_with_what_arrived():
    boxes, scores, idxs = torch.zeros(3, 4), torch.zeros(3), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=r"\bvalid\b.*\[3\].*Float"):
        ops.batched_nms_padded(boxes, scores, idxs, 0.5, valid=torch.ones(3))
    with pytest.raises(RuntimeError, match=r"\bvalid\b.*\[3\].*\[2\]"):
        ops.batched_nms_padded(boxes, scores, idxs, 0.5, valid=torch.ones(2, dtype=torch.bool))


def test_nms_rejects_bad_shapes_with_what_arrived():
    with pytest.raises(RuntimeError, match=r"boxes.*\[3, 5\]"):
        ops.nms(torch.zeros(3, 5), torch.zeros(3), 0.5)
    with pytest.raises(RuntimeError, match="scores"):
        ops.nms(torch.zeros(3, 4), torch.zeros(4), 0.5)
    with pytest.raises(RuntimeError, match="idxs"):
        ops.batched_nms(torch.zeros(3, 4), torch.zeros(3), torch.zeros(2, dtype=torch.int64), 0.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_box_iou_matches_torchvision(device, dtype):
    a = random_boxes(37, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    b = random_boxes(2001, clusters=10).to(device, dtype)
    got = ops.box_iou(a, b)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    expected = torchvision.ops.box_iou(a.double(), b.double())
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(reference.box_iou(a, b).double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_box_iou_degenerate_and_empty(device):
    a = torch.tensor([[5.0, 5, 5, 5], [0, 0, 10, 10]], device=device)
    iou = ops.box_iou(a, a)
    assert iou.tolist() == [[0.0, 0.0], [0.0, 1.0]]  # torchvision gives NaN for the zero-area pair
    assert ops.box_iou(a[:0], a).shape == (0, 2)
    assert ops.box_iou(a, a[:0]).shape == (2, 0)


def test_box_iou_mixed_dtypes_promote():
    a = random_boxes(4).half()
    b = random_boxes(5).double()
    assert ops.box_iou(a, b).dtype == torch.float64


def test_opcheck():
    boxes, scores = random_boxes(300, clusters=10), distinct_scores(300)
    idxs = torch.randint(3, (300,))
    torch.library.opcheck(torch.ops.lit_amp_det.nms.default, (boxes, scores, 0.5, 50))
    torch.library.opcheck(torch.ops.lit_amp_det.batched_nms.default, (boxes, scores, idxs, 0.5, -1))
    torch.library.opcheck(torch.ops.lit_amp_det.box_iou.default, (boxes[:10], boxes))
    for valid in (None, scores > 0.5):
        torch.library.opcheck(
            torch.ops.lit_amp_det.batched_nms_padded.default, (boxes, scores, idxs, valid, 0.5, 40, 300)
        )


def test_compile_fullgraph():
    boxes, scores = random_boxes(500, clusters=10), distinct_scores(500)
    idxs = torch.randint(3, (500,))

    def select(boxes, scores, idxs):
        keep = ops.batched_nms(boxes, scores, idxs, 0.5, max_output=100)
        first = ops.nms(boxes, scores, 0.5, max_output=10)
        padded, count = ops.batched_nms_padded(boxes, scores, idxs, 0.5, 100, valid=scores > 0.3)
        return boxes[keep], ops.box_iou(boxes[first], boxes), boxes[padded.clamp(min=0)], count

    compiled = torch.compile(select, fullgraph=True, backend="aot_eager")
    for got, expected in zip(compiled(boxes, scores, idxs), select(boxes, scores, idxs)):
        torch.testing.assert_close(got, expected)

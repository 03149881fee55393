"""The rules both R-CNN pipelines share (:mod:`lit_amp_det.models.detection_core`) against torchvision's, and
padding rows (the fixed-shape pipeline's ``valid``/``sampled`` masks) left out of every result.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torchvision.models.detection import _utils as det_utils
from torchvision.models.detection import roi_heads as tv_roi_heads
from torchvision.ops import boxes as box_ops

from lit_amp_det.models import detection_core as core
from ops_inputs import random_boxes

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: the padded and unpadded sums below are compared at a stated tolerance, and the
    rest bitwise.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("thresholds", [(0.5, 0.5, False), (0.7, 0.3, True)])
def test_labels_from_matches_are_torchvisions_roi_head_labels(thresholds):
    g = torch.Generator().manual_seed(0)
    gt_boxes = random_boxes(5, image=(64, 64), max_size=40, generator=g)
    gt_labels = torch.tensor([3, 1, 2, 2, 5])
    proposals = random_boxes(200, image=(64, 64), max_size=40, clusters=5, generator=g)
    matcher = det_utils.Matcher(*thresholds)
    heads = tv_roi_heads.RoIHeads(None, None, None, 0.5, 0.5, 16, 0.25, None, 0.05, 0.5, 10)
    heads.proposal_matcher = matcher
    expected_matched, expected_labels = heads.assign_targets_to_proposals(
        [proposals], [gt_boxes], [gt_labels]
    )
    matches = matcher(box_ops.box_iou(gt_boxes, proposals))
    matched, labels = core.labels_from_matches(matches, gt_labels, matcher)
    assert torch.equal(matched, expected_matched[0]) and torch.equal(labels, expected_labels[0])
    assert (labels == 0).any() and (labels > 0).any()
    background = heads.assign_targets_to_proposals([proposals], [gt_boxes[:0]], [gt_labels[:0]])
    for got, want in zip(core.background_labels(200, proposals.device), background):
        assert torch.equal(got, want[0])


def _box_head_batch(rows: int, classes: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    class_logits = torch.randn(rows, classes, generator=g)
    box_regression = torch.randn(rows, classes * 4, generator=g)
    labels = torch.randint(0, classes, (rows,), generator=g)
    regression_targets = torch.randn(rows, 4, generator=g)
    return class_logits, box_regression, labels, regression_targets


def test_box_head_losses_are_torchvisions_and_ignore_padding_rows():
    batch = _box_head_batch(96, 5)
    expected = tv_roi_heads.fastrcnn_loss(batch[0], batch[1], [batch[2]], [batch[3]])
    got = core.box_head_losses(*batch)
    for value, want in zip(got, expected):
        torch.testing.assert_close(value, want, rtol=1e-6, atol=0)
    # padding rows: garbage logits, an ignored label and an inf target (a degenerate box's code)
    logits, regression, labels, targets = _box_head_batch(32, 5, seed=1)
    padded = (
        torch.cat([batch[0], logits * 100]),
        torch.cat([batch[1], regression]),
        torch.cat([batch[2], torch.full((32,), -1)]),
        torch.cat([batch[3], torch.full_like(targets, float("inf"))]),
    )
    sampled = torch.arange(128) < 96
    padded[0].requires_grad_(True)
    masked = core.box_head_losses(*padded, sampled=sampled)
    for value, want in zip(masked, expected):
        torch.testing.assert_close(value, want, rtol=1e-6, atol=0)
    sum(masked).backward()
    assert torch.isfinite(padded[0].grad).all() and not padded[0].grad[96:].any()


def test_mask_head_loss_is_torchvisions_and_ignores_padding_rows():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(12, 4, 14, 14, generator=g)
    classes = torch.randint(1, 4, (12,), generator=g)
    targets = torch.rand(12, 14, 14, generator=g).round()
    rows = torch.arange(12)
    expected = torch.nn.functional.binary_cross_entropy_with_logits(logits[rows, classes], targets)
    torch.testing.assert_close(core.mask_head_loss(logits, classes, targets), expected, rtol=1e-6, atol=0)
    positive = torch.arange(16) < 12
    padded = core.mask_head_loss(
        torch.cat([logits, torch.randn(4, 4, 14, 14, generator=g) * 50]),
        torch.cat([classes, torch.zeros(4, dtype=torch.int64)]),
        torch.cat([targets, torch.ones(4, 14, 14)]),
        positive,
    )
    torch.testing.assert_close(padded, expected, rtol=1e-6, atol=0)
    nothing = torch.zeros(0, 4, 14, 14, requires_grad=True)
    empty = core.mask_head_loss(nothing, classes[:0], targets[:0])
    assert empty.item() == 0.0 and empty.requires_grad  # still part of the graph


def test_detection_candidates_are_torchvisions_filters():
    g = torch.Generator().manual_seed(4)
    proposals = random_boxes(50, image=(60, 80), max_size=50, generator=g)
    codes = torch.randn(50, 4 * 4, generator=g) * 0.2
    scores = torch.softmax(torch.randn(50, 4, generator=g) * 2, -1)
    decoded = det_utils.BoxCoder((10.0, 10.0, 5.0, 5.0)).decode(codes, [proposals])
    decoded[3, 2] = decoded[3, 0]  # a zero-width box is dropped
    boxes, kept_scores, labels, usable = core.detection_candidates(decoded, scores, (60, 80), 0.1)
    clipped = box_ops.clip_boxes_to_image(decoded, (60, 80))[:, 1:].reshape(-1, 4)
    expected_labels = torch.arange(1, 4).repeat(50)
    expected_scores = scores[:, 1:].reshape(-1)
    keep = torch.where(expected_scores > 0.1)[0]
    keep = keep[box_ops.remove_small_boxes(clipped[keep], min_size=1e-2)]
    assert torch.equal(boxes, clipped) and torch.equal(labels, expected_labels)
    assert torch.equal(kept_scores, expected_scores)
    assert torch.equal(torch.where(usable)[0], keep) and 0 < keep.numel() < usable.numel()


def test_proposal_candidates_are_torchvisions_filters():
    g = torch.Generator().manual_seed(5)
    boxes = random_boxes(80, image=(50, 70), max_size=30, generator=g) - 10
    scores = torch.rand(80, generator=g)
    clipped, usable = core.proposal_candidates(boxes, scores, (50, 70), 3.0, 0.2)
    expected = box_ops.clip_boxes_to_image(boxes, (50, 70))
    keep = box_ops.remove_small_boxes(expected, 3.0)
    keep = keep[scores[keep] >= 0.2]
    assert torch.equal(clipped, expected)
    assert torch.equal(torch.where(usable)[0], keep) and 0 < keep.numel() < 80


def _python_files() -> list[Path]:
    files = [p for folder in ("lit_amp_det", "tools", "tests") for p in (ROOT / folder).rglob("*.py")]
    assert len(files) > 50
    return files


def test_no_code_reclasses_a_module_or_asks_hasattr_forward_padded():
    """The fixed-shape and extension-op heads are built, not re-classed, and recognised by
    ``is_fixed_shape`` alone.
    """
    offences = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Attribute) and t.attr == "__class__" for t in targets):
                offences.append(f"{path}:{node.lineno} assigns __class__")
            is_lookup = isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                "hasattr",
                "getattr",
            )
            named = is_lookup and any(
                isinstance(a, ast.Constant) and a.value == "forward_padded" for a in node.args
            )
            if named:
                offences.append(f"{path}:{node.lineno} looks up forward_padded by name")
    assert not offences, offences

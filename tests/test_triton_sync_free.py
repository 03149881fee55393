"""NMS without host synchronisation: the padded results agree with the unpadded ones, the RPN's padded proposal
selection (its CUDA path) selects exactly what the per-filter path selects, and on a GPU none of the Triton ops
synchronises with the host (the RPN reads its kept counts once per batch)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.roi_heads import RoIHeads
from torchvision.models.detection.rpn import RegionProposalNetwork, RPNHead

import lit_amp_det.ops as ops
from lit_amp_det.models import ext_ops
from lit_amp_det.ops import triton as tops
from ops_inputs import distinct_scores, needs_extension, on_cuda_only, random_boxes, random_rois

pytestmark = needs_extension


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rpn(training: bool) -> ext_ops.ExtRegionProposalNetwork:
    rpn = RegionProposalNetwork(
        AnchorGenerator(((32,),), ((1.0,),)), RPNHead(4, 1), fg_iou_thresh=0.7, bg_iou_thresh=0.3,
        batch_size_per_image=8, positive_fraction=0.5, pre_nms_top_n=dict(training=60, testing=40),
        post_nms_top_n=dict(training=25, testing=12), nms_thresh=0.5, score_thresh=0.3,
    )
    rpn.min_size = 6.0
    rpn.__class__ = ext_ops.ExtRegionProposalNetwork
    return rpn.train(training)


@pytest.mark.parametrize("training", [True, False])
def test_rpn_padded_selection_matches_the_per_filter_path(monkeypatch, training):
    rpn = _rpn(training)
    g = torch.Generator().manual_seed(0)
    proposals = torch.stack([random_boxes(150, image=(96, 128), min_size=2, max_size=60, clusters=8,
                                          generator=torch.Generator().manual_seed(i)) for i in range(2)])
    objectness = torch.randn(2 * 150, 1, generator=g)
    args = (proposals, objectness, [(96, 128), (90, 120)], [100, 50])
    expected_boxes, expected_scores = rpn.filter_proposals(*args)
    monkeypatch.setattr(ext_ops, "_sync_free", lambda t: True)  # the CUDA path, interpreted on the CPU
    boxes, scores = rpn.filter_proposals(*args)
    assert [b.shape[0] for b in boxes] == [b.shape[0] for b in expected_boxes]
    assert 0 < boxes[0].shape[0] <= rpn.post_nms_top_n()
    for got, expected in zip(boxes + scores, expected_boxes + expected_scores):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("max_class_size", [None, 70])
def test_padded_nms_of_the_valid_boxes_is_nms_of_the_valid_subset(max_class_size):
    boxes = random_boxes(260, image=(100, 100), max_size=50, clusters=4)  # 5 mask words, banded to 3
    scores = distinct_scores(260)
    classes = torch.arange(260) // 65  # four classes of 65 boxes
    valid = scores > 0.3
    keep, count = tops.batched_nms_padded(boxes, scores, classes, 0.5, 40, valid=valid,
                                          max_class_size=max_class_size)
    members = torch.nonzero(valid).flatten()
    expected = members[ops.batched_nms(boxes[members], scores[members], classes[members], 0.5, 40)]
    assert 0 < int(count) <= 40
    assert torch.equal(keep[: int(count)], expected)
    keep, count = tops.nms_padded(boxes, scores, 0.5, valid=valid)
    assert torch.equal(keep[: int(count)], members[ops.nms(boxes[members], scores[members], 0.5)])


def test_detector_padded_postprocessing_matches_the_per_image_path(monkeypatch):
    heads = RoIHeads(None, None, None, 0.5, 0.5, 16, 0.25, None, score_thresh=0.1, nms_thresh=0.5,
                     detections_per_img=15)
    heads.__class__ = ext_ops.ExtRoIHeads
    g = torch.Generator().manual_seed(3)
    proposals = [random_boxes(40, image=(64, 80), max_size=40, clusters=5, generator=torch.Generator().manual_seed(i))
                 for i in range(2)]
    class_logits = torch.randn(80, 4, generator=g) * 2
    box_regression = torch.randn(80, 16, generator=g) * 0.1
    args = (class_logits, box_regression, proposals, [(64, 80), (60, 70)])
    expected = heads.postprocess_detections(*args)
    monkeypatch.setattr(ext_ops, "_sync_free", lambda t: True)  # the CUDA path, interpreted on the CPU
    got = heads.postprocess_detections(*args)
    assert [b.shape[0] for b in got[0]] == [b.shape[0] for b in expected[0]]
    assert got[0][0].shape[0] > 0
    for got_part, expected_part in zip(got, expected):
        for g_t, e_t in zip(got_part, expected_part):
            assert torch.equal(g_t, e_t)


@on_cuda_only  # host syncs are counted on CUDA only
def test_triton_ops_do_not_synchronise_with_the_host(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    device = torch.device("cuda")
    boxes = random_boxes(3000, clusters=40).to(device)
    scores = distinct_scores(3000).to(device)
    classes = torch.randint(5, (3000,)).to(device)
    x = torch.randn(2, 64, 100, 152, device=device, requires_grad=True)
    rois = random_rois(300, 2, (800, 1216)).to(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tops.nms_padded(boxes, scores, 0.7, 1000)
        tops.batched_nms_padded(boxes, scores, classes, 0.5, 100)
        ops.box_iou(boxes[:100], boxes)
        ops.roi_align(x, rois, 7, 0.125, 2).sum().backward()
        ops.multi_level_roi_align([x, x[:, :, ::2, ::2]], rois, classes[:300].clamp(max=1), [0.125, 0.0625], 7, 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@on_cuda_only  # host syncs are counted on CUDA only
def test_rpn_step_on_cuda_reads_the_counts_once(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    rpn = _rpn(True).cuda()
    proposals = torch.stack([random_boxes(150, image=(96, 128), clusters=8) for _ in range(4)]).cuda()
    objectness = torch.randn(4 * 150, 1, device="cuda")
    args = (proposals, objectness, [(96, 128)] * 4, [100, 50])
    rpn.filter_proposals(*args)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rpn.filter_proposals(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]

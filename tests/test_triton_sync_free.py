"""NMS without host synchronisation: the padded results agree with the unpadded ones, the sync-free RPN's
proposal slots and the detector's detection slots hold exactly what the per-filter paths select, with the C++
op and with the Triton kernels (the CUDA path, interpreted), and on a GPU none of the Triton ops synchronises
with the host.
"""

from __future__ import annotations

import pytest
import torch
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.roi_heads import RoIHeads
from torchvision.models.detection.rpn import RegionProposalNetwork, RPNHead

import lit_amp_det.ops as ops
from lit_amp_det.models import ext_ops, sync_free
from lit_amp_det.ops.triton import _launch as tops
from ops_inputs import distinct_scores, needs_extension, on_cuda_only, random_boxes, random_rois

pytestmark = needs_extension


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rpn(training: bool, cls: type = ext_ops.ExtRegionProposalNetwork) -> ext_ops.ExtRegionProposalNetwork:
    rpn = RegionProposalNetwork(
        AnchorGenerator(((32,),), ((1.0,),)),
        RPNHead(4, 1),
        fg_iou_thresh=0.7,
        bg_iou_thresh=0.3,
        batch_size_per_image=8,
        positive_fraction=0.5,
        pre_nms_top_n=dict(training=60, testing=40),
        post_nms_top_n=dict(training=25, testing=12),
        nms_thresh=0.5,
        score_thresh=0.3,
    )
    rpn.min_size = 6.0
    return cls.from_rpn(rpn.train(training))


def _triton_nms(monkeypatch) -> None:
    """The sync-free heads call the Triton launcher that ``lit_amp_det::batched_nms_padded`` runs on CUDA."""
    from lit_amp_det.ops.triton import _register

    def launcher(boxes, scores, idxs, iou_threshold, max_output=-1, *, valid=None, max_class_size=None):
        bound = -1 if max_class_size is None else max_class_size
        return _register._batched_nms_padded(boxes, scores, idxs, valid, iou_threshold, max_output, bound)

    monkeypatch.setattr(sync_free, "batched_nms_padded", launcher)


@pytest.mark.parametrize("kernel", ["cpu", "triton"])
@pytest.mark.parametrize("training", [True, False])
def test_rpn_proposal_slots_hold_the_per_filter_selection(monkeypatch, training, kernel):
    g = torch.Generator().manual_seed(0)
    proposals = torch.stack(
        [
            random_boxes(
                150,
                image=(96, 128),
                min_size=2,
                max_size=60,
                clusters=8,
                generator=torch.Generator().manual_seed(i),
            )
            for i in range(2)
        ]
    )
    objectness = torch.randn(2 * 150, 1, generator=g)
    args = (proposals, objectness, [(96, 128), (90, 120)], [100, 50])
    expected_boxes, _ = _rpn(training).filter_proposals(*args)
    if kernel == "triton":
        _triton_nms(monkeypatch)
    rpn = _rpn(training, sync_free.SyncFreeRPN)
    boxes, valid = rpn.filter_proposals(*args)
    assert boxes.shape == (2, rpn.post_nms_top_n(), 4) and valid.shape == (2, rpn.post_nms_top_n())
    assert 0 < expected_boxes[0].shape[0] <= rpn.post_nms_top_n()
    for got, slot_valid, expected in zip(boxes, valid, expected_boxes):
        assert (
            slot_valid.sum() == expected.shape[0] and slot_valid[: expected.shape[0]].all()
        )  # valid slots first
        assert torch.equal(got[: expected.shape[0]], expected)


@pytest.mark.parametrize("max_class_size", [None, 70])
def test_padded_nms_of_the_valid_boxes_is_nms_of_the_valid_subset(max_class_size):
    boxes = random_boxes(260, image=(100, 100), max_size=50, clusters=4)  # 5 mask words, banded to 3
    scores = distinct_scores(260)
    classes = torch.arange(260) // 65  # four classes of 65 boxes
    valid = scores > 0.3
    keep, count = tops.batched_nms_padded(
        boxes, scores, classes, 0.5, 40, valid=valid, max_class_size=max_class_size
    )
    members = torch.nonzero(valid).flatten()
    expected = members[ops.batched_nms(boxes[members], scores[members], classes[members], 0.5, 40)]
    assert 0 < int(count) <= 40
    assert torch.equal(keep[: int(count)], expected)
    keep, count = tops.nms_padded(boxes, scores, 0.5, valid=valid)
    assert torch.equal(keep[: int(count)], members[ops.nms(boxes[members], scores[members], 0.5)])


@pytest.mark.parametrize("kernel", ["cpu", "triton"])
def test_detection_slots_hold_the_per_image_detections(monkeypatch, kernel):
    heads = RoIHeads(
        None, None, None, 0.5, 0.5, 16, 0.25, None, score_thresh=0.1, nms_thresh=0.5, detections_per_img=15
    )
    heads = ext_ops.ExtRoIHeads.from_roi_heads(heads)
    g = torch.Generator().manual_seed(3)
    proposals = torch.stack(
        [
            random_boxes(
                40, image=(64, 80), max_size=40, clusters=5, generator=torch.Generator().manual_seed(i)
            )
            for i in range(2)
        ]
    )
    valid = torch.arange(40) < torch.tensor(
        [[40], [31]]
    )  # the second image's last proposal slots are padding
    class_logits = torch.randn(80, 4, generator=g) * 2
    box_regression = torch.randn(80, 16, generator=g) * 0.1
    expected = heads.postprocess_detections(
        class_logits[torch.cat([valid[0], valid[1]])],
        box_regression[torch.cat([valid[0], valid[1]])],
        [proposals[0], proposals[1][:31]],
        [(64, 80), (60, 70)],
    )
    if kernel == "triton":
        _triton_nms(monkeypatch)
    heads = sync_free.SyncFreeRoIHeads.from_roi_heads(heads)
    boxes, scores, labels, counts = heads.postprocess_detections(
        class_logits, box_regression, (proposals, valid), [(64, 80), (60, 70)]
    )
    assert boxes.shape == (2, 15, 4) and counts.tolist() == [b.shape[0] for b in expected[0]]
    assert counts[0] > 0
    for i, n in enumerate(counts.tolist()):
        for got, want in zip(
            (boxes[i], scores[i], labels[i]), (expected[0][i], expected[1][i], expected[2][i])
        ):
            assert torch.equal(got[:n], want)


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
        ops.multi_level_roi_align(
            [x, x[:, :, ::2, ::2]], rois, classes[:300].clamp(max=1), [0.125, 0.0625], 7, 2
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")


@on_cuda_only  # host syncs are counted on CUDA only
def test_sync_free_rpn_on_cuda_never_reads_the_device(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    rpn = _rpn(True, sync_free.SyncFreeRPN).cuda()
    proposals = torch.stack([random_boxes(150, image=(96, 128), clusters=8) for _ in range(4)]).cuda()
    objectness = torch.randn(4 * 150, 1, device="cuda")
    args = (proposals, objectness, [(96, 128)] * 4, [100, 50])
    rpn.filter_proposals(*args)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rpn.filter_proposals(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")

"""The fixed-shape Mask R-CNN (``speedups.sync_free``): no host synchronisation in a training step, none in
inference before the one read of the counts, one graph for ``torch.compile``, torchvision's matching and
sampling statistics, torchvision's detections and masks.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.models.detection._utils import BalancedPositiveNegativeSampler, Matcher
from torchvision.models.detection.roi_heads import paste_masks_in_image

from lit_amp_det.models import sync_free
from lit_amp_det.models.detection_core import paste_masks_padded
from lit_amp_det.models.maskrcnn import build_detector
from lit_amp_det.models.speedups import BinaryMaskPaste, ExtensionOps, SyncFree
from lit_amp_det.models.sync_free import (
    FixedShapeTransform,
    SyncFreeMaskRCNN,
    fixed_shape_detector,
    match,
    sample_slots,
)
from lit_amp_det.profiling import HostSyncs
from ops_inputs import needs_extension, on_cuda_only, random_boxes

pytestmark = needs_extension


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread in every test: the comparisons below are bitwise, and a reduction split over
    another number of threads may round differently (the suite runs with any ``OMP_NUM_THREADS``, and under
    xdist).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _sync_free(model: torch.nn.Module) -> torch.nn.Module:
    return SyncFree(devices=["cpu"])(BinaryMaskPaste()(ExtensionOps()(model)))


# ------------------------------------------------------------------------------------------------ matching


@pytest.mark.parametrize("thresholds", [(0.7, 0.3, True), (0.5, 0.5, False), (0.5, 0.4, True)])
def test_match_is_torchvisions_matcher(thresholds):
    matcher = Matcher(*thresholds)
    g = torch.Generator().manual_seed(0)
    for gt, n in ((1, 50), (4, 300), (9, 7)):
        quality = (torch.rand(gt, n, generator=g) * 10).round() / 10  # many ties, values on the thresholds
        quality[:, :3] = 0.0  # columns no row overlaps
        assert torch.equal(match(quality, matcher), matcher(quality)), (gt, n)


# ------------------------------------------------------------------------------------------------ sampling


@pytest.mark.parametrize(
    "positives, negatives, ignored",
    [(3, 200, 20), (100, 300, 0), (0, 50, 5), (40, 0, 3), (0, 0, 10), (10, 20, 0)],
)
def test_sample_slots_draws_as_many_as_torchvisions_sampler(positives, negatives, ignored):
    labels = torch.cat(
        [
            torch.randint(1, 5, (positives,)),
            torch.zeros(negatives, dtype=torch.int64),
            torch.full((ignored,), -1),
        ]
    )
    labels = labels[torch.randperm(labels.shape[0])]
    sampler = BalancedPositiveNegativeSampler(64, 0.25)
    expected_pos, expected_neg = (int(m[0].sum()) for m in sampler([labels]))
    index, valid, positive = sample_slots(labels, 64, 0.25)
    assert index.shape == valid.shape == positive.shape == (min(64, labels.shape[0]),)
    assert int((valid & positive).sum()) == expected_pos and int((valid & ~positive).sum()) == expected_neg
    drawn = index[valid]
    assert drawn.unique().numel() == drawn.numel()  # no element twice
    assert (labels[index[valid & positive]] >= 1).all() and (labels[index[valid & ~positive]] == 0).all()
    assert (
        not (positive & ~valid).any() and (positive[:-1].int() >= positive[1:].int()).all()
    )  # positives first


def test_sample_slots_without_room_for_a_positive_draws_negatives_only():
    labels = torch.tensor([1, 1, 0, 0, 0, -1])
    index, valid, positive = sample_slots(
        labels, 3, 0.25
    )  # int(3 * 0.25) = 0 positives, as torchvision draws
    assert not positive.any() and valid.all() and (labels[index] == 0).all() and index.unique().numel() == 3


def test_sample_slots_draws_each_candidate_equally_often():
    labels = torch.tensor([1] * 10 + [0] * 30)
    torch.manual_seed(0)
    counts = torch.zeros(40)
    for _ in range(600):
        index, valid, _ = sample_slots(labels, 16, 0.25)  # 4 of 10 positives, 12 of 30 negatives
        counts.index_add_(0, index[valid], torch.ones(int(valid.sum())))
    frequency = counts / 600
    assert ((frequency[:10] - 0.4).abs() < 0.08).all(), frequency[:10]
    assert ((frequency[10:] - 0.4).abs() < 0.08).all(), frequency[10:]


# ------------------------------------------------------------------------------------------------ mask paste


@pytest.mark.parametrize("threshold", [0.5, 0.2, -0.1])
def test_padded_paste_is_torchvisions_paste_thresholded(threshold):
    g = torch.Generator().manual_seed(0)
    boxes = torch.cat(
        [
            random_boxes(40, image=(70, 90), min_size=1, max_size=60, generator=g),
            torch.tensor(
                [
                    [-20.0, -10, 30, 25],
                    [60, 50, 140, 120],
                    [5, 5, 5.4, 5.2],
                    [200, 200, 230, 260],
                    [0, 0, 90, 70],
                ]
            ),
        ]
    )
    masks = torch.rand(boxes.shape[0], 1, 28, 28, generator=g)
    expected = paste_masks_in_image(masks, boxes, (70, 90), padding=1) > threshold
    got = paste_masks_padded(masks, boxes, (70, 90), threshold)
    assert got.shape == expected.shape and got.dtype == torch.bool
    assert torch.equal(got, expected), int((got != expected).sum())
    assert paste_masks_padded(masks[:0], boxes[:0], (70, 90), threshold).shape == (0, 1, 70, 90)


# ------------------------------------------------------------------------------------------------ the model


def _tiny() -> torch.nn.Module:
    from host_syncs import tiny_model

    return tiny_model()


def test_a_training_step_makes_no_host_sync():
    """Forward, backward and the optimizer step of the tiny Mask R-CNN: not one value read."""
    from host_syncs import count

    syncs = count(_sync_free(_tiny()), train=True)
    assert syncs.total == 0, syncs.table()


@on_cuda_only  # CUDA's own sync detector on the real kernels
def test_a_training_step_and_padded_inference_on_cuda_never_wait_for_the_gpu(monkeypatch):
    from host_syncs import batch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = _sync_free(_tiny()).cuda().train()
    images, targets = batch()
    images, targets = [i.cuda() for i in images], [{k: v.cuda() for k, v in t.items()} for t in targets]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)

    def step() -> None:
        sum(model(images, targets).values()).backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # compiles the kernels, creates the momentum buffers
    model.eval()
    with torch.no_grad():
        model.forward_padded(images)
    model.train()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        model.eval()
        with torch.no_grad():
            model.forward_padded(images)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.slow
def test_an_r50_fpn_training_step_makes_no_host_sync():
    from host_syncs import batch

    torch.manual_seed(0)
    model = _sync_free(
        build_detector(
            5,
            backbone={"name": "resnet50", "fpn_channels": 256, "trainable_layers": 3, "norm": "frozen_bn"},
            transform={"min_size": 128, "max_size": 128},
            rpn={"pre_nms_top_n_train": 2000, "post_nms_top_n_train": 2000, "batch_size_per_image": 256},
            roi_heads={"box_head_width": 1024, "batch_size_per_image": 512},
        )
    )
    images, targets = batch()
    for t in targets:
        t["labels"] = t["labels"].clamp(max=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.train()
    with HostSyncs() as syncs:
        sum(model(images, targets).values()).backward()
        optimizer.step()
    assert syncs.total == 0, syncs.table()


def test_inference_reads_the_device_once_per_batch():
    from host_syncs import batch

    model = _sync_free(_tiny()).eval()
    images, _ = batch()
    with torch.no_grad(), HostSyncs() as syncs:
        padded = model.forward_padded(images)
    assert syncs.total == 0, syncs.table()
    assert [d["boxes"].shape for d in padded] == [(model.roi_heads.detections_per_img, 4)] * 2
    with torch.no_grad(), HostSyncs() as syncs:
        model(images)
    # the counts of the batch, read once, in forward
    ((what, site),) = syncs.sites
    assert what == "Tensor.tolist" and site.startswith(str(Path(sync_free.__file__))), syncs.table()
    assert syncs.total == 1 and syncs.kinds["host read"] == 1, syncs.table()


@pytest.mark.parametrize("training", [True, False])
def test_the_forward_is_one_graph(training):
    import torch._dynamo

    from host_syncs import batch

    model = _sync_free(_tiny()).train(training)
    images, targets = batch()
    torch._dynamo.reset()
    explain = torch._dynamo.explain(model.forward_padded)
    result = explain(images, targets) if training else explain(images)
    assert result.graph_break_count == 0 and result.graph_count == 1, [b.reason for b in result.break_reasons]


def test_same_detections_and_masks_as_the_dynamic_path_on_the_validation_split():
    from hydra.utils import instantiate

    from conftest import compose_config

    data = instantiate(compose_config().data)
    data.setup("validate")
    torch.manual_seed(0)
    dynamic = BinaryMaskPaste()(
        ExtensionOps()(
            build_detector(
                7,
                backbone={"name": "resnet10", "fpn_channels": 32},
                transform={"min_size": 160, "max_size": 160},
                roi_heads={"box_head_width": 64, "mask_head_layers": [16], "score_thresh": 0.05},
            )
        )
    ).eval()
    torch.nn.init.normal_(dynamic.roi_heads.box_predictor.cls_score.weight, std=0.5)  # spread the scores
    fixed = SyncFree(devices=["cpu"])(copy.deepcopy(dynamic)).eval()
    compared = pixels = 0
    with torch.no_grad():
        for images, _ in data.val_dataloader():
            images = [image.float() / 255 for image in images]
            for a, b in zip(dynamic(images), fixed(images)):
                assert a["boxes"].shape == b["boxes"].shape and torch.equal(a["labels"], b["labels"])
                torch.testing.assert_close(b["boxes"], a["boxes"], rtol=0, atol=1e-3)
                assert torch.equal(a["scores"], b["scores"])
                pixels += int((a["masks"] != b["masks"]).sum())  # interpolated values rounded the other way
                compared += a["labels"].numel()
    assert compared > 100 and pixels <= compared * 160 * 160 // 100_000, pixels


def test_training_draws_torchvisions_sample_sizes():
    """The RoI heads' draw keeps torchvision's counts: positives up to the fraction, negatives filling the
    batch.
    """
    from host_syncs import batch

    model = _sync_free(_tiny()).train()
    images, targets = batch()
    heads = model.roi_heads
    proposals = random_boxes(80, image=(128, 128), max_size=90, clusters=4)
    valid = torch.arange(80) < 70
    boxes, _, labels, drawn, positive = heads._draw(
        proposals, valid, targets[0]["boxes"], targets[0]["labels"]
    )
    reference = copy.deepcopy(heads)
    _, _, expected, _ = (
        type(heads).__mro__[2].select_training_samples(reference, [proposals[:70]], targets[:1])
    )
    assert int((drawn & positive).sum()) == int((expected[0] > 0).sum())
    assert int(drawn.sum()) == expected[0].numel() and (labels[drawn & positive] > 0).all()


def test_fixed_shape_batches_repeat_their_shape():
    transform = FixedShapeTransform(
        build_detector(
            3,
            backbone={"name": "resnet10", "fpn_channels": 32},
            transform={"min_size": [96, 100], "max_size": 150},
        ).transform,
        0.5,
    )
    transform.train()
    shapes = set()
    for size in ((80, 120), (60, 90), (120, 70), (100, 100)):
        batch, _ = transform([torch.rand(3, *size), torch.rand(3, 50, 75)])
        shapes.add(tuple(batch.tensors.shape[-2:]))
    assert shapes <= {(128, 160), (160, 128), (160, 160)} and len(shapes) >= 2
    # an image no bucket holds (resizing skipped) is batched as torchvision batches it
    assert transform.batch_images([torch.rand(3, 170, 90)]).shape == (1, 3, 192, 96)


def test_faster_rcnn_trains_without_a_host_sync_and_detects_as_the_dynamic_path():
    from host_syncs import batch, count

    torch.manual_seed(0)
    dynamic = ExtensionOps()(
        build_detector(
            7,
            mask=False,
            backbone={"name": "resnet10", "fpn_channels": 32},
            transform={"min_size": 128, "max_size": 128},
        )
    )
    torch.nn.init.normal_(dynamic.roi_heads.box_predictor.cls_score.weight, std=0.5)  # spread the scores
    fixed = SyncFree(devices=["cpu"])(copy.deepcopy(dynamic))
    assert type(fixed).__name__ == "SyncFreeFasterRCNN"
    images, _ = batch()
    with torch.no_grad():
        for a, b in zip(dynamic.eval()(images), fixed.eval()(images)):
            assert a["boxes"].shape[0] > 0 and a.keys() == b.keys() == {"boxes", "scores", "labels"}
            assert torch.equal(a["boxes"], b["boxes"]) and torch.equal(a["labels"], b["labels"])
    assert count(fixed, train=True).total == 0


def test_sync_free_keeps_the_weights_and_refuses_other_detectors():
    model = _tiny()
    keys = list(model.state_dict())
    converted = fixed_shape_detector(model)
    assert type(converted) is SyncFreeMaskRCNN and list(converted.state_dict()) == keys
    assert fixed_shape_detector(converted) is converted
    with pytest.raises(TypeError, match=r"speedups\.sync_free=null"):
        fixed_shape_detector(torch.nn.Linear(2, 2))


def test_the_fixed_shape_detector_is_built_from_the_parts_and_leaves_the_model_as_it_was():
    """A new detector of new heads around the same submodules: the given model keeps its classes (nothing is
    re-classed), the two share their parameters, and the heads carry the settings over.
    """
    from torchvision.models.detection import MaskRCNN
    from torchvision.models.detection.roi_heads import RoIHeads
    from torchvision.models.detection.rpn import RegionProposalNetwork

    model = build_detector(
        5,
        backbone={"name": "resnet10", "fpn_channels": 32},
        rpn={"post_nms_top_n_train": 77, "nms_thresh": 0.6, "fg_iou_thresh": 0.65},
        roi_heads={"detections_per_img": 9, "score_thresh": 0.2, "batch_size_per_image": 40},
    ).eval()
    fixed = sync_free.fixed_shape_detector(model)
    assert fixed is not model and sync_free.is_fixed_shape(fixed) and not sync_free.is_fixed_shape(model)
    assert type(model) is MaskRCNN and type(model.rpn) is RegionProposalNetwork
    assert type(model.roi_heads) is RoIHeads
    assert type(fixed.rpn) is sync_free.SyncFreeRPN and type(fixed.roi_heads) is sync_free.SyncFreeRoIHeads
    assert not fixed.training and not fixed.rpn.training and not fixed.roi_heads.training
    assert fixed.backbone is model.backbone and fixed.roi_heads.box_head is model.roi_heads.box_head
    assert fixed.rpn.head is model.rpn.head and fixed.rpn.anchor_generator is model.rpn.anchor_generator
    assert fixed.rpn._post_nms_top_n == model.rpn._post_nms_top_n and fixed.rpn.post_nms_top_n() == 1000
    for name in ("nms_thresh", "score_thresh", "min_size"):
        assert getattr(fixed.rpn, name) == getattr(model.rpn, name), name
    assert fixed.rpn.proposal_matcher.high_threshold == 0.65
    for name in ("detections_per_img", "score_thresh", "nms_thresh"):
        assert getattr(fixed.roi_heads, name) == getattr(model.roi_heads, name), name
    assert fixed.roi_heads.fg_bg_sampler.batch_size_per_image == 40
    assert fixed.roi_heads.box_coder.weights == model.roi_heads.box_coder.weights
    assert list(fixed.state_dict()) == list(model.state_dict())


def test_build_detector_builds_the_fixed_shape_detector() -> None:
    settings = dict(backbone={"name": "resnet10", "fpn_channels": 32}, transform={"min_size": 96})
    torch.manual_seed(0)
    fixed = build_detector(3, fixed_shape=True, **settings)
    torch.manual_seed(0)
    dynamic = build_detector(3, **settings)
    assert type(fixed) is SyncFreeMaskRCNN and type(fixed.transform) is FixedShapeTransform
    assert type(build_detector(3, mask=False, fixed_shape=True, **settings)).__name__ == "SyncFreeFasterRCNN"
    expected = dynamic.state_dict()
    assert all(torch.equal(value, expected[key]) for key, value in fixed.state_dict().items())


def test_a_degenerate_box_is_refused_with_torchvisions_words():
    from host_syncs import batch

    model = _sync_free(_tiny()).train()
    images, targets = batch()
    targets[1]["boxes"][1, 2] = targets[1]["boxes"][1, 0]
    with pytest.raises(RuntimeError, match="positive height and width: target 1"):
        model(images, targets)


def test_compile_takes_the_whole_sync_free_detector():
    from host_syncs import batch
    from lit_amp_det.models.speedups import CompileBackbone

    model = _sync_free(_tiny()).train()
    eager = copy.deepcopy(model)
    CompileBackbone(backend="eager")(model)  # the compile path without inductor's build time
    assert model._compiled_call_impl is not None and model.backbone._compiled_call_impl is None
    images, targets = batch()
    torch.manual_seed(3)
    expected = eager(images, targets)
    torch.manual_seed(3)
    for key, value in model(images, targets).items():
        torch.testing.assert_close(value, expected[key])


# ------------------------------------------------------------------------------------------------ static
# shapes


class _ShapeTrace(TorchDispatchMode):
    """Every aten call and the shapes of its outputs, in order: what a CUDA graph would have to replay."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[tuple[int, ...], ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves(out)
        self.calls.append((str(func), tuple(tuple(t.shape) for t in leaves if isinstance(t, torch.Tensor))))
        return out


def _targets(counts: list[int]) -> list[dict[str, torch.Tensor]]:
    """Targets of 128x128 images with ``counts[i]`` instances each."""
    targets = []
    for count in counts:
        boxes = torch.tensor(
            [[10.0 + 20 * k, 10.0 + 15 * k, 60.0 + 20 * k, 70.0 + 15 * k] for k in range(count)]
        )
        masks = torch.zeros(count, 128, 128, dtype=torch.uint8)
        for k, (x1, y1, x2, y2) in enumerate(boxes.int().tolist()):
            masks[k, y1:y2, x1:x2] = 1
        targets.append({"boxes": boxes.reshape(-1, 4), "labels": torch.arange(1, count + 1), "masks": masks})
    return targets


def test_padded_targets_give_every_training_step_the_same_shapes():
    """With ``data.pad_instances`` every step runs the same ops on the same shapes, whatever the images hold:
    no allocation depends on the data (with no host sync, what capturing the step in a CUDA graph needs).
    """
    from host_syncs import batch
    from lit_amp_det.data.coco import pad_instances

    model = _sync_free(_tiny()).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images, _ = batch()
    traces = []
    for counts in ([1, 3], [4, 0], [2, 2]):  # the first step also creates the momentum buffers
        targets = [pad_instances(t, 4) for t in _targets(counts)]
        with _ShapeTrace() as trace:
            sum(model(images, targets).values()).backward()
            optimizer.step()
            optimizer.zero_grad()
        traces.append(trace.calls)
    assert len(traces[1]) > 1000 and traces[1] == traces[2]


def test_padding_changes_no_anchor_draw_and_no_loss_term_kind():
    from host_syncs import batch
    from lit_amp_det.data.coco import pad_instances

    model = _sync_free(_tiny()).train()
    images, _ = batch()
    losses = []
    for pad in (None, 6):
        targets = _targets([2, 0])
        targets = targets if pad is None else [pad_instances(t, pad) for t in targets]
        torch.manual_seed(5)
        losses.append({k: float(v) for k, v in model(images, targets).items()})
    assert losses[0].keys() == losses[1].keys()
    for key in ("loss_objectness", "loss_rpn_box_reg"):  # the RPN draws first, from the same keys
        assert losses[0][key] == pytest.approx(losses[1][key], rel=1e-6), key
    assert all(torch.isfinite(torch.tensor(list(step.values()))).all() for step in losses)


def test_padding_refuses_an_image_with_more_instances_and_a_detector_that_cannot_read_it():
    from lit_amp_det import MaskRCNNModule
    from lit_amp_det.data.coco import pad_instances

    target = {**_targets([3])[0], "image_id": torch.tensor(42)}
    with pytest.raises(
        ValueError, match=r"data\.pad_instances=2\) is less than the 3 instances of image_id 42"
    ):
        pad_instances(target, 2)
    module = MaskRCNNModule(
        7, backbone={"name": "resnet10", "fpn_channels": 32}, transform={"min_size": 128, "max_size": 128}
    )
    module.configure_model()  # on a CPU: no sync_free
    with pytest.raises(ValueError, match="speedups.sync_free.devices"):
        module.training_step(([torch.rand(3, 128, 128)], [pad_instances(target, 4)]), 0)


@on_cuda_only  # the capture itself: what the CPU tests above prepare
def test_a_whole_training_step_replays_as_one_cuda_graph(monkeypatch):
    """Forward, backward and the fused optimizer step of the sync-free detector captured in one CUDA graph,
    replayed on static input buffers refilled with other images' padded targets (``tools/cuda_graph_step.py``
    times it).
    """
    from cuda_graph_step import capture_step, padded_targets
    from host_syncs import batch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = _sync_free(_tiny()).cuda().train()
    images = [image.cuda() for image in batch()[0]]
    targets = padded_targets(_targets([1, 3]), 4, "cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)
    graph, losses = capture_step(model, optimizer, images, targets)
    before = [p.detach().clone() for p in model.parameters()]
    for counts in ([4, 0], [2, 2]):
        for buffer, new in zip(targets, padded_targets(_targets(counts), 4, "cuda")):
            for key, value in buffer.items():
                value.copy_(new[key])
        graph.replay()
        assert torch.isfinite(losses).all()
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


# ------------------------------------------------------------------- no tensors from host numbers in a step
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_device_box_coder_codes_as_torchvision_does(dtype) -> None:
    from torchvision.models.detection._utils import BoxCoder

    from lit_amp_det.models.sync_free import DeviceBoxCoder

    g = torch.Generator().manual_seed(0)
    corners = torch.rand(300, 2, generator=g) * 500
    reference = torch.cat([corners, corners + 1 + torch.rand(300, 2, generator=g) * 300], 1).to(dtype)
    proposals = (reference + torch.rand(300, 4, generator=g) * torch.tensor([-5.0, -5.0, 5.0, 5.0])).to(dtype)
    codes = (torch.randn(300, 8, generator=g) * 2).to(dtype)  # two classes' deltas
    for weights in [(1.0, 1.0, 1.0, 1.0), (10.0, 10.0, 5.0, 5.0)]:
        ours, theirs = DeviceBoxCoder(weights, math.log(1000 / 16)), BoxCoder(weights)
        assert torch.equal(
            ours.encode_single(reference, proposals), theirs.encode_single(reference, proposals)
        )
        assert torch.equal(
            ours.decode(codes, [proposals[:100], proposals[100:]]),
            theirs.decode(codes, [proposals[:100], proposals[100:]]),
        )


def test_boxes_rescale_with_python_ratios_as_torchvision_rescales_them() -> None:
    from torchvision.models.detection.transform import resize_boxes

    from lit_amp_det.models.sync_free import scale_boxes

    g = torch.Generator().manual_seed(0)
    boxes = torch.rand(500, 4, generator=g) * 1333
    for old, new in [
        ((480, 640), (800, 1066)),
        ((427, 640), (800, 1199)),
        ((333, 500), (128, 192)),
        ((7, 3), (13, 5)),
    ]:
        assert torch.equal(scale_boxes(boxes, old, new), resize_boxes(boxes, list(old), list(new)))
    assert scale_boxes(boxes[:0], (10, 10), (20, 20)).shape == (0, 4)


def test_the_fixed_shape_transform_normalises_and_resizes_as_torchvision() -> None:
    """The same images and targets as torchvision's transform, training and inference (one scale, so that both
    draw the same size); only the padding differs (a size bucket).
    """
    from torchvision.models.detection.transform import GeneralizedRCNNTransform

    from host_syncs import batch
    from lit_amp_det.models.sync_free import FixedShapeTransform

    theirs = GeneralizedRCNNTransform(96, 160, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    ours = FixedShapeTransform(theirs, 0.5)
    images, targets = batch()
    for training in (True, False):
        theirs.train(training), ours.train(training)
        expected, expected_targets = theirs(images, copy.deepcopy(targets) if training else None)
        got, got_targets = ours(images, copy.deepcopy(targets) if training else None)
        assert got.image_sizes == expected.image_sizes
        for index, (height, width) in enumerate(got.image_sizes):  # ours pads to a size bucket
            region = (index, slice(None), slice(0, height), slice(0, width))
            assert torch.equal(got.tensors[region], expected.tensors[region])
        for g, e in zip(got_targets or [], expected_targets or []):
            assert torch.equal(g["boxes"], e["boxes"]) and torch.equal(g["masks"], e["masks"])


def test_the_data_module_pads_to_the_fixed_shape_detectors_instance_count():
    """``speedups.sync_free.instances_per_image`` is the one setting: the detector carries it, the module
    exposes it, the data module pads a training batch to it; a disagreeing ``data.pad_instances`` is refused.
    """
    from types import SimpleNamespace

    from hydra.utils import instantiate

    from conftest import compose_config
    from lit_amp_det import MaskRCNNModule
    from lit_amp_det.models.speedups import DEFAULT_SPEEDUPS

    sync_free_on_cpu = {
        **DEFAULT_SPEEDUPS,
        "sync_free": {**DEFAULT_SPEEDUPS["sync_free"], "devices": ["cpu"], "instances_per_image": 4},
    }
    settings = dict(backbone={"name": "resnet10", "fpn_channels": 32}, transform={"min_size": 128})
    module = MaskRCNNModule(7, speedups=sync_free_on_cpu, **settings)
    module.configure_model()
    assert module.instances_per_image == module.model.instances_per_image == 4
    data = instantiate(compose_config().data)
    data.trainer = SimpleNamespace(lightning_module=module)
    assert data.pad_instances is None and data.padded_instance_count() == 4
    data.pad_instances = 4
    assert data.padded_instance_count() == 4
    data.pad_instances = 6
    with pytest.raises(ValueError, match=r"speedups\.sync_free\.instances_per_image=4"):
        data.padded_instance_count()
    dynamic = MaskRCNNModule(7, **settings)
    dynamic.configure_model()  # on a CPU: no sync_free
    data.trainer = SimpleNamespace(lightning_module=dynamic)
    assert dynamic.instances_per_image is None and data.padded_instance_count() == 6
    with pytest.raises(ValueError, match=r"instances_per_image=0"):
        SyncFree(instances_per_image=0)

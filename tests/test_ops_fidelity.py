"""Drop-in fidelity of the ops on the inputs users meet: elongated batches, fx tracing, TorchScript, integer
and infinite boxes, empty inputs, RoIs that address no image, half-precision level mapping, threshold
rounding, ``max_output`` at word boundaries, score dtypes, NaN scores and arbitrary class ids.

Cases follow torchvision's ``test/test_ops.py`` (``TestNMS``, ``TestBoxIou``, ``TestRoIAlign``,
``TestMultiScaleRoIAlign``) where it has them, compared against torchvision itself.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torchvision

import lit_amp_det.ops as ops
from lit_amp_det.ops import reference
from ops_inputs import distinct_scores, needs_extension, random_boxes, random_rois

pytestmark = needs_extension

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
LAYOUTS = [torch.contiguous_format, torch.channels_last]


def _fpn(sizes, channels=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {str(i): torch.randn(1, channels, h, w, generator=g) for i, (h, w) in enumerate(sizes)}


# --- MultiScaleRoIAlign: scale inference as torchvision's -------------------------------------------------


def test_elongated_batch_pools_as_torchvision():
    """A 200 x 1000 image resized to 45 x 224 in a 64 x 224 padded batch: the height and width ratios of the
    stride-4 map (16 / 45, 56 / 224) round to different powers of two. torchvision takes the height's; the
    module used to raise here (and crashed the default model on any 5:1 image).
    """
    x = _fpn([(16, 56), (8, 28), (4, 14), (2, 7)])
    boxes = [torch.tensor([[0.0, 0, 224, 45], [10, 5, 60, 40], [100, 0, 223, 44]])]
    shapes = [(45, 224)]
    ours = ops.MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)
    theirs = torchvision.ops.MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)
    torch.testing.assert_close(ours(x, boxes, shapes), theirs(x, boxes, shapes), rtol=0, atol=1e-6)
    assert ours.scales == theirs.scales


def test_scales_are_inferred_once_and_kept_as_torchvision():
    names = ["0", "1", "2", "3"]
    ours, theirs = ops.MultiScaleRoIAlign(names, 5, 2), torchvision.ops.MultiScaleRoIAlign(names, 5, 2)
    batches = [
        (_fpn([(64, 64), (32, 32), (16, 16), (8, 8)]), [(256, 256)]),
        (_fpn([(16, 56), (8, 28), (4, 14), (2, 7)], seed=1), [(45, 224)]),  # would infer other scales alone
    ]
    for x, shapes in batches:
        boxes = [random_boxes(20, image=shapes[0], max_size=200)]
        torch.testing.assert_close(ours(x, boxes, shapes), theirs(x, boxes, shapes), rtol=0, atol=1e-6)
        assert ours.scales == theirs.scales == [0.25, 0.125, 0.0625, 0.03125]


def test_scales_of_a_torchvision_pooler_that_already_ran_are_carried_over():
    from lit_amp_det.models.ext_ops import lit_pooler

    theirs = torchvision.ops.MultiScaleRoIAlign(["0", "1"], 3, 2)
    theirs(_fpn([(32, 32), (16, 16)]), [random_boxes(4, image=(128, 128))], [(128, 128)])
    assert lit_pooler(theirs).scales == theirs.scales == [0.25, 0.125]


def test_levels_of_different_dtypes_are_pooled_in_the_first_levels_dtype():
    x = _fpn([(32, 32), (16, 16)])
    x["1"] = x["1"].double()
    boxes = [random_boxes(10, image=(128, 128))]
    ours = ops.MultiScaleRoIAlign(["0", "1"], 3, 2)(x, boxes, [(128, 128)])
    # torchvision's CPU kernel wants rois of the level's dtype, so it is given the levels already cast
    theirs = torchvision.ops.MultiScaleRoIAlign(["0", "1"], 3, 2)(
        {k: v.float() for k, v in x.items()}, boxes, [(128, 128)]
    )
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_level_mapping_of_half_boxes_upcasts_before_the_area(dtype):
    """fp16 areas overflow past 256 x 256 px (300 x 300 went to the top level); torchvision upcasts first."""
    edges = [300.0, 1000.0, 223.0, 224.0, 225.0, 447.0, 448.0, 449.0, 111.0, 112.0, 113.0]
    boxes = torch.tensor([[0.0, 0.0, e, e] for e in edges]).to(dtype)
    x = _fpn([(256, 256), (128, 128), (64, 64), (32, 32)])
    theirs = torchvision.ops.MultiScaleRoIAlign(["0", "1", "2", "3"], 3, 2)
    theirs(x, [boxes.float()], [(1024, 1024)])
    expected = theirs.map_levels([boxes])
    assert torch.equal(ops.assign_fpn_levels(boxes, 2, 5), expected)
    assert ops.assign_fpn_levels(boxes, 2, 5)[0].item() == 2  # [0, 0, 300, 300]: level 4 of 2..5


# --- fx and TorchScript -----------------------------------------------------------------------------------


def test_fx_symbolic_trace_of_roi_align_and_multi_scale_roi_align():
    x = _fpn([(32, 32), (16, 16)])
    boxes = [random_boxes(6, image=(128, 128)), random_boxes(3, image=(128, 128))]
    for module, args in (
        (ops.RoIAlign(3, 0.25, 2), (x["0"].expand(2, -1, -1, -1).contiguous(), boxes)),
        (ops.MultiScaleRoIAlign(["0", "1"], 3, 2), (x, boxes, [(128, 128)])),
    ):
        traced = torch.fx.symbolic_trace(module)
        torch.testing.assert_close(traced(*args), module(*args))
    # tracing leaves no placeholder behind in the traced module's scales
    fresh = ops.MultiScaleRoIAlign(["0", "1"], 3, 2)
    torch.fx.symbolic_trace(fresh)
    assert fresh.scales is None


def test_fx_feature_extraction_of_a_model_on_the_extension_ops():
    from torchvision.models.feature_extraction import create_feature_extractor

    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pool = ops.MultiScaleRoIAlign(["0", "1"], 3, 2)

        def forward(self, a, b, boxes):
            return self.pool({"0": a, "1": b}, boxes, [(128, 128)]).relu()

    x = _fpn([(32, 32), (16, 16)])
    boxes = [random_boxes(6, image=(128, 128))]
    extractor = create_feature_extractor(Pool(), return_nodes=["relu"])
    torch.testing.assert_close(extractor(x["0"], x["1"], boxes)["relu"], Pool()(x["0"], x["1"], boxes))


def _script(fn):
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"`torch\.jit\.script` is deprecated", category=FutureWarning
        )
        return torch.jit.script(fn)


def test_functional_ops_and_roi_align_module_script_like_torchvision():
    boxes, scores = random_boxes(200, clusters=10), distinct_scores(200)
    idxs = torch.randint(3, (200,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_script(ops.nms)(boxes, scores, 0.5, 20), ops.nms(boxes, scores, 0.5, 20))
    assert torch.equal(
        _script(ops.batched_nms)(boxes, scores, idxs, 0.5, -1), ops.batched_nms(boxes, scores, idxs, 0.5)
    )
    assert torch.equal(_script(ops.box_iou)(boxes[:5], boxes), ops.box_iou(boxes[:5], boxes))
    x = torch.randn(2, 4, 16, 16)
    rois = random_rois(7, 2, (64, 64))
    per_image = [rois[:3, 1:], rois[3:, 1:]]
    scripted = _script(ops.roi_align)
    torch.testing.assert_close(
        scripted(x, rois, (3, 2), 0.25, 2, True), ops.roi_align(x, rois, (3, 2), 0.25, 2, True)
    )
    torch.testing.assert_close(
        scripted(x, per_image, 3, 0.25, -1, False), ops.roi_align(x, per_image, 3, 0.25)
    )
    module = ops.RoIAlign(3, 0.25, 2)
    torch.testing.assert_close(_script(module)(x, rois), module(x, rois))


def test_scripting_multi_scale_roi_align_says_what_to_use_instead():
    with pytest.raises(RuntimeError, match=r"torch\.compile or torch\.export"):
        _script(ops.MultiScaleRoIAlign(["0"], 7, 2))


# --- box_iou ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.int16]
)  # uint8 wraps around in torchvision
def test_box_iou_accepts_integer_boxes_as_torchvision(dtype):
    a = torch.tensor([[0, 0, 100, 100], [0, 0, 50, 50], [200, 100, 230, 130]], dtype=dtype)
    b = torch.tensor([[0, 0, 100, 100], [0, 0, 25, 25], [10, 10, 20, 20], [40, 40, 90, 95]], dtype=dtype)
    got = ops.box_iou(a, b)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torchvision.ops.box_iou(a, b), rtol=1e-7, atol=0)


def test_box_iou_mixed_integer_and_float_boxes():
    a = torch.tensor([[0, 0, 10, 10]])
    b = torch.tensor([[0.0, 0, 5, 10], [2.5, 2.5, 7.5, 7.5]], dtype=torch.float64)
    torch.testing.assert_close(ops.box_iou(a, b), torchvision.ops.box_iou(a.double(), b).float())


@pytest.mark.parametrize("dtype", FLOATS)
def test_box_iou_of_infinite_or_nan_coordinates_is_zero_not_nan(dtype):
    inf, nan = math.inf, math.nan
    a = torch.tensor(
        [[0, 0, inf, inf], [-inf, -inf, inf, inf], [0, 0, 10, 10], [nan, 0, 10, 10]], dtype=dtype
    )
    for iou in (ops.box_iou(a, a), reference.box_iou(a, a)):
        assert not iou.isnan().any()
        assert iou[2, 2] == 1 and iou[0, 2] == 0 and iou[0, 0] == 0


# --- NMS
# ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_nms_threshold_compared_as_torchvision_rounds_it(dtype):
    """IoU([0,0,10,1], [0,0,1,1]) = 0.1: fp32 0.1 is above the double 0.1, so torchvision suppresses."""
    boxes = torch.tensor([[0, 0, 10, 1], [0, 0, 1, 1]], dtype=dtype)
    scores = torch.tensor([0.9, 0.8], dtype=dtype)
    expected = torchvision.ops.nms(
        boxes.to(torch.float64 if dtype == torch.float64 else torch.float32),
        scores.float().to(torch.float64 if dtype == torch.float64 else torch.float32),
        0.1,
    )
    assert ops.nms(boxes, scores, 0.1).tolist() == expected.tolist()
    assert reference.nms(boxes, scores, 0.1).tolist() == expected.tolist()
    if dtype != torch.float64:
        assert expected.tolist() == [0]


@pytest.mark.parametrize("max_output", [63, 64, 65])
def test_nms_max_output_at_word_boundaries(max_output):
    """200 boxes in a grid (none overlaps another) plus a suppressed copy of every third one."""
    grid = (
        torch.stack(torch.meshgrid(torch.arange(20.0), torch.arange(10.0), indexing="ij"), -1).reshape(-1, 2)
        * 20
    )
    boxes = torch.cat([grid, grid + 10], dim=1)
    copies = boxes[::3] + 0.5
    all_boxes = torch.cat([boxes, copies])
    scores = distinct_scores(all_boxes.shape[0])
    full = torchvision.ops.nms(all_boxes, scores, 0.5)
    assert full.numel() == 200
    for k in (max_output, max_output - 1, max_output + 1):
        assert torch.equal(ops.nms(all_boxes, scores, 0.5, k), full[:k])
        assert torch.equal(
            ops.batched_nms(all_boxes, scores, torch.zeros(len(scores), dtype=torch.int64), 0.5, k), full[:k]
        )


@pytest.mark.parametrize("box_dtype", FLOATS)
@pytest.mark.parametrize("score_dtype", FLOATS)
def test_nms_scores_in_any_dtype_and_other_than_the_boxes(box_dtype, score_dtype):
    boxes = random_boxes(400, clusters=20).to(box_dtype)
    scores = distinct_scores(400).to(score_dtype)
    iou_dtype = torch.float64 if box_dtype == torch.float64 else torch.float32
    # torchvision on the same (rounded) values; a stable sort of the rounded scores decides the visiting order
    expected = torchvision.ops.nms(boxes.to(iou_dtype), scores.to(iou_dtype), 0.5)
    assert torch.equal(ops.nms(boxes, scores, 0.5), expected)
    assert torch.equal(reference.nms(boxes, scores, 0.5), expected)


def test_nms_nan_scores_as_torchvision():
    """torch.sort puts NaN first in a descending sort; torchvision's CPU NMS then visits NaN boxes first."""
    boxes = random_boxes(60, clusters=6)
    scores = distinct_scores(60)
    scores[[3, 17, 40]] = math.nan
    expected = torchvision.ops.nms(boxes, scores, 0.5)
    assert torch.equal(ops.nms(boxes, scores, 0.5), expected)
    assert torch.equal(reference.nms(boxes, scores, 0.5), expected)


def test_batched_nms_arbitrary_int64_class_ids():
    boxes = random_boxes(500, clusters=15)
    scores = distinct_scores(500)
    ids = torch.tensor([-(2**62), -1, 0, 7, 2**40, 2**63 - 1])
    idxs = ids[torch.randint(len(ids), (500,), generator=torch.Generator().manual_seed(3))]
    dense = torch.unique(idxs, return_inverse=True)[1]  # torchvision's offset trick needs small ids
    expected = torchvision.ops.batched_nms(boxes, scores, dense, 0.5)
    assert torch.equal(ops.batched_nms(boxes, scores, idxs, 0.5), expected)
    assert torch.equal(ops.batched_nms(boxes, scores, idxs, 0.5, 30), expected[:30])
    assert torch.equal(reference.batched_nms(boxes, scores, idxs, 0.5), expected)


@pytest.mark.parametrize("max_output", [-1, 0, 5])
def test_nms_and_batched_nms_on_empty_inputs_as_torchvision(max_output):
    empty_boxes = torch.empty(0, 4)
    for scores, idxs in (
        (torch.empty(0), torch.empty(0, dtype=torch.int64)),
        (torch.empty(0, dtype=torch.float16), torch.empty(0)),  # float idxs: torchvision still returns empty
        (torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.int32)),
    ):
        assert torchvision.ops.batched_nms(empty_boxes, scores.float(), idxs, 0.5).shape == (0,)
        for result in (
            ops.batched_nms(empty_boxes, scores, idxs, 0.5, max_output),
            ops.nms(empty_boxes, scores, 0.5, max_output),
        ):
            assert result.shape == (0,) and result.dtype == torch.int64


# --- RoIAlign: RoIs that address no image, gradient layouts -------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rois_outside_the_batch_pool_to_zeros_without_gradient(layout):
    """Batch index truncated toward zero as torchvision does; outside [0, N) (NaN too) gives a zero row and no
    gradient, on every device (a GPU kernel cannot raise without a host sync).
    """
    x = torch.randn(2, 3, 12, 12).contiguous(memory_format=layout).requires_grad_()
    box = [1.0, 1, 9, 9]
    rois = torch.tensor([[i] + box for i in (0, 1, -1, 2, 7, math.nan, -0.5, 1.7)])
    out = ops.roi_align(x, rois, 3, 1.0, 2)
    valid = torch.tensor([True, True, False, False, False, False, True, True])
    assert out[~valid].abs().sum() == 0 and (out[valid].abs().sum(dim=(1, 2, 3)) > 0).all()
    torch.testing.assert_close(out[valid], torchvision.ops.roi_align(x, rois[valid], 3, 1.0, 2))
    torch.testing.assert_close(reference.roi_align(x, rois, 3, 1.0, 2), out)
    out[~valid].sum().backward()
    assert x.grad.abs().sum() == 0


def test_multi_level_rois_with_an_out_of_range_level_or_batch_index_pool_to_zeros():
    features = [torch.randn(2, 3, 16, 16), torch.randn(2, 3, 8, 8)]
    rois = torch.tensor([[0, 1.0, 1, 30, 30], [1, 1, 1, 30, 30], [5, 1, 1, 30, 30], [0, 1, 1, 30, 30]])
    levels = torch.tensor([0, 1, 0, 2])
    out = ops.multi_level_roi_align(features, rois, levels, [0.5, 0.25], 3, 2)
    assert out[2:].abs().sum() == 0 and out[:2].abs().sum() > 0
    torch.testing.assert_close(
        reference.multi_level_roi_align(features, rois, levels, [0.5, 0.25], 3, 2), out
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_follow_the_input_layout(layout, dtype):
    x = torch.randn(2, 8, 16, 20, dtype=dtype).contiguous(memory_format=layout).requires_grad_()
    rois = random_rois(12, 2, (64, 80))
    ops.roi_align(x, rois, 3, 0.25, 2).sum().backward()
    assert x.grad.is_contiguous(memory_format=layout) and x.grad.dtype == dtype
    features = [
        f.contiguous(memory_format=layout).requires_grad_()
        for f in (torch.randn(2, 8, 16, 20, dtype=dtype), torch.randn(2, 8, 8, 10, dtype=dtype))
    ]
    levels = torch.randint(2, (12,), generator=torch.Generator().manual_seed(0))
    ops.multi_level_roi_align(features, rois, levels, [0.25, 0.125], 3, 2).sum().backward()
    for f in features:
        assert f.grad.is_contiguous(memory_format=layout) and f.grad.dtype == dtype

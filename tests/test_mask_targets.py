"""Mask targets of the whole batch in one RoIAlign call against torchvision's per-image
``project_masks_on_boxes``.
"""

from __future__ import annotations

import pytest
import torch
import torchvision.models.detection.roi_heads as tv_roi_heads
from torch import Tensor

from lit_amp_det.models import mask_targets
from lit_amp_det.models.ext_ops import ExtRoIHeads, use_extension_ops
from lit_amp_det.models.mask_targets import maskrcnn_loss, project_masks_on_boxes
from lit_amp_det.models.maskrcnn import build_detector
from ops_inputs import needs_extension, random_boxes

pytestmark = needs_extension


def _image(
    masks: int, size: tuple[int, int], positives: int, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random blob masks, proposals reaching the image border, matched indices and labels of one image."""
    g = torch.Generator().manual_seed(seed)
    height, width = size
    gt = (torch.rand(masks, height, width, generator=g) > 0.6).to(torch.uint8)
    boxes = random_boxes(positives, image=size, min_size=2.0, max_size=max(size) * 0.9, generator=g)
    boxes = torch.cat([torch.tensor([[0.0, 0.0, width, height]]), boxes])[
        :positives
    ]  # one box is the whole image
    boxes[:, 0::2] = boxes[:, 0::2].clamp(0, width)  # proposals are clipped to the image, as the RPN does
    boxes[:, 1::2] = boxes[:, 1::2].clamp(0, height)
    idxs = (
        torch.randint(max(masks, 1), (positives,), generator=g)
        if masks
        else torch.zeros(0, dtype=torch.int64)
    )
    labels = torch.randint(1, 5, (masks,), generator=g)
    return gt, boxes, idxs, labels


def _batch(sizes: list[tuple[int, int]], masks: list[int], positives: list[int]):
    images = [_image(m, s, p, seed) for seed, (s, m, p) in enumerate(zip(sizes, masks, positives))]
    return tuple(list(column) for column in zip(*images))


CASES = {
    "same size, one image without positives": ([(96, 96)] * 3, [4, 3, 2], [9, 0, 5]),
    "an image without ground truth": ([(64, 80)] * 2, [0, 3], [0, 7]),
    "three sizes, interleaved": ([(96, 96), (64, 80), (96, 96), (50, 40)], [3, 2, 4, 1], [6, 4, 0, 3]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_targets_equal_torchvision_per_image(case: str) -> None:
    gt_masks, proposals, idxs, _ = _batch(*CASES[case])
    expected = torch.cat(
        [tv_roi_heads.project_masks_on_boxes(m, p, i, 28) for m, p, i in zip(gt_masks, proposals, idxs)]
    )
    got = project_masks_on_boxes(gt_masks, proposals, idxs, 28)
    assert got.shape == expected.shape == (sum(p.shape[0] for p in proposals), 28, 28)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert expected.amax() > 0.5 and expected.amin() < 0.5  # the crops hold both mask and background


def test_one_roi_align_call_per_distinct_mask_size(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    original = mask_targets.roi_align

    def counting(input, rois, *args, **kwargs):
        calls.append(tuple(input.shape))
        return original(input, rois, *args, **kwargs)

    monkeypatch.setattr(mask_targets, "roi_align", counting)
    project_masks_on_boxes(*_batch(*CASES["same size, one image without positives"])[:3], 28)
    assert calls == [(6, 1, 96, 96)]  # the images with positives, 4 + 2 masks, one call
    calls.clear()
    project_masks_on_boxes(*_batch(*CASES["three sizes, interleaved"])[:3], 28)
    assert sorted(calls) == [
        (1, 1, 50, 40),
        (2, 1, 64, 80),
        (3, 1, 96, 96),
    ]  # the 96 px image without positives
    # contributes neither a call nor masks


def test_no_positive_anywhere_gives_empty_targets_and_a_zero_loss_in_the_graph() -> None:
    gt_masks, proposals, idxs, labels = _batch([(64, 64)] * 2, [2, 0], [0, 0])
    assert project_masks_on_boxes(gt_masks, proposals, idxs, 14).shape == (0, 14, 14)
    logits = torch.randn(0, 5, 14, 14, requires_grad=True)
    loss = maskrcnn_loss(logits, proposals, gt_masks, labels, idxs)
    loss.backward()
    assert loss.item() == 0.0 and logits.grad is not None


def test_loss_and_gradient_equal_torchvision() -> None:
    gt_masks, proposals, idxs, labels = _batch(*CASES["three sizes, interleaved"])
    logits = torch.randn(
        sum(p.shape[0] for p in proposals), 5, 28, 28, generator=torch.Generator().manual_seed(3)
    )
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = maskrcnn_loss(ours, proposals, gt_masks, labels, idxs)
    expected = tv_roi_heads.maskrcnn_loss(theirs, proposals, gt_masks, labels, idxs)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-9)


def test_ext_heads_train_masks_with_batched_targets_and_the_switch_restores_torchvision(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A training step of the ext model calls the batched loss (not torchvision's) and gives torchvision's
    losses; ``batched_mask_targets=False`` on the instance runs torchvision's own branch.
    """
    torch.manual_seed(0)
    model = use_extension_ops(
        build_detector(
            7,
            backbone={"name": "resnet10", "fpn_channels": 32},
            transform={"min_size": 96, "max_size": 96},
            roi_heads={"mask_head_layers": [16]},
        )
    )
    assert type(model.roi_heads) is ExtRoIHeads
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 96, 96, generator=g) for _ in range(2)]
    masks = torch.zeros(2, 96, 96, dtype=torch.uint8)
    masks[0, 10:60, 20:70] = 1
    masks[1, 40:90, 30:80] = 1
    targets = [
        {
            "boxes": torch.tensor([[20.0, 10, 70, 60], [30, 40, 80, 90]]),
            "labels": torch.tensor([1, 4]),
            "masks": masks,
        },
        {
            "boxes": torch.zeros(0, 4),
            "labels": torch.zeros(0, dtype=torch.int64),
            "masks": torch.zeros(0, 96, 96, dtype=torch.uint8),
        },
    ]
    batched: list[int] = []
    monkeypatch.setattr(
        mask_targets, "project_masks_on_boxes", lambda *a: batched.append(1) or project_masks_on_boxes(*a)
    )
    per_image: list[int] = []
    original = tv_roi_heads.project_masks_on_boxes
    monkeypatch.setattr(
        tv_roi_heads, "project_masks_on_boxes", lambda *a: per_image.append(1) or original(*a)
    )
    model.train()

    def losses() -> dict[str, Tensor]:
        torch.manual_seed(1)  # the samplers draw the same proposals
        return model(images, targets)

    ours = losses()
    assert batched == [1] and per_image == []
    model.roi_heads.batched_mask_targets = False
    theirs = losses()
    assert batched == [1] and per_image == [1, 1]  # torchvision: one call per image
    assert ours.keys() == theirs.keys() and ours["loss_mask"] > 0
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-7)

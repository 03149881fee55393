"""The ``binary_mask_paste`` speedup: masks pasted as booleans box by box equal torchvision's float paste
thresholded, bit for bit (``paste_masks_in_image`` is the reference), for every dtype, empty and degenerate
inputs, and whole models.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from torch import nn
from torchvision.models.detection.roi_heads import paste_masks_in_image
from torchvision.models.detection.transform import GeneralizedRCNNTransform
from torchvision.ops import clip_boxes_to_image

from conftest import compose_config, smooth_activations
from lit_amp_det.checkpoints import IMPLEMENTATION_HPARAMS
from lit_amp_det.models.mask_paste import BinaryMaskTransform, paste_masks_binary, use_binary_mask_paste


def _detections(
    count: int, height: int, width: int, seed: int, dtype: torch.dtype = torch.float32, mask_side: int = 28
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask probabilities and boxes as torchvision's RoI heads hand them over: boxes clipped to the image
    (some of them crossing its border before clipping, some of zero width or height).
    """
    gen = torch.Generator().manual_seed(seed)
    masks = torch.rand(count, 1, mask_side, mask_side, generator=gen).to(dtype)
    corner = torch.rand(count, 2, generator=gen) * torch.tensor(
        [1.3 * width, 1.3 * height]
    ) - 0.15 * torch.tensor([width, height])
    size = torch.rand(count, 2, generator=gen) * torch.tensor([width, height])
    size[::4] = 0.0  # degenerate boxes
    boxes = clip_boxes_to_image(torch.cat([corner, corner + size], dim=1), (height, width))
    return masks, boxes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("threshold", [0.5, 0.0, 0.93, -0.1])
def test_the_same_booleans_as_torchvision_s_paste_thresholded(dtype: torch.dtype, threshold: float) -> None:
    for seed, (count, height, width) in enumerate([(9, 37, 53), (5, 1, 40), (7, 64, 1), (12, 480, 640)]):
        masks, boxes = _detections(count, height, width, seed, dtype)
        expected = paste_masks_in_image(masks, boxes, (height, width)) > threshold
        pasted = paste_masks_binary(masks, boxes, (height, width), threshold)
        assert pasted.dtype == torch.bool and pasted.shape == (count, 1, height, width)
        assert torch.equal(pasted, expected), (seed, (pasted != expected).sum())
        if (
            height * width > 1000 and threshold >= 0
        ):  # neither all False nor all True: the comparison has content
            assert 0 < int(pasted.sum()) < pasted.numel()


def test_a_real_size_paste_and_other_mask_sides_and_paddings() -> None:
    masks, boxes = _detections(50, 800, 1216, seed=7)
    assert torch.equal(
        paste_masks_binary(masks, boxes, (800, 1216), 0.5),
        paste_masks_in_image(masks, boxes, (800, 1216)) > 0.5,
    )
    masks, boxes = _detections(6, 90, 70, seed=8, mask_side=14)
    for padding in (0, 1, 3):
        assert torch.equal(
            paste_masks_binary(masks, boxes, (90, 70), 0.5, padding=padding),
            paste_masks_in_image(masks, boxes, (90, 70), padding=padding) > 0.5,
        )


def test_no_detections_and_boxes_outside_the_image() -> None:
    empty = paste_masks_binary(torch.zeros(0, 1, 28, 28), torch.zeros(0, 4), (30, 40), 0.5)
    assert empty.shape == (0, 1, 30, 40) and empty.dtype == torch.bool
    assert empty.shape == paste_masks_in_image(torch.zeros(0, 1, 28, 28), torch.zeros(0, 4), (30, 40)).shape
    # unclipped boxes wholly outside (torchvision's paste fails on some: it slices with negative stops)
    outside = torch.tensor([[50.0, 5.0, 60.0, 9.0], [-30.0, -20.0, -10.0, -5.0]])
    pasted = paste_masks_binary(torch.ones(2, 1, 28, 28), outside, (30, 40), 0.5)
    assert not pasted.any()
    assert paste_masks_binary(
        torch.ones(2, 1, 28, 28), outside, (30, 40), -0.5
    ).all()  # 0 > -0.5, as the canvas


def test_the_transform_is_torchvision_s_but_for_the_masks() -> None:
    torchvision_transform = GeneralizedRCNNTransform(
        64, 96, [0.4, 0.5, 0.6], [0.2, 0.3, 0.25], size_divisible=16
    )
    torchvision_transform.eval()
    binary = BinaryMaskTransform(torchvision_transform, 0.5).eval()
    images = [torch.rand(3, 40, 60), torch.rand(3, 50, 30)]
    batch, _ = torchvision_transform(images)
    again, _ = binary(images)
    assert torch.equal(batch.tensors, again.tensors) and batch.image_sizes == again.image_sizes
    masks, boxes = _detections(5, 64, 96, seed=3)
    raw = [
        {
            "boxes": boxes.clone(),
            "masks": masks,
            "scores": torch.rand(5),
            "labels": torch.ones(5, dtype=torch.int64),
            "keypoints": torch.rand(5, 3, 3) * 64,
        }
    ]
    expected = torchvision_transform.postprocess([dict(raw[0])], [(64, 96)], [(40, 60)])[0]
    got = binary.postprocess([dict(raw[0])], [(64, 96)], [(40, 60)])[0]
    assert torch.equal(got["boxes"], expected["boxes"]) and torch.equal(
        got["keypoints"], expected["keypoints"]
    )
    assert torch.equal(got["masks"], expected["masks"] > 0.5)
    binary.train()
    untouched = [dict(raw[0])]
    assert binary.postprocess(untouched, [(64, 96)], [(40, 60)])[0]["masks"] is masks  # training: no paste


def _module(tmp_path: Path, *overrides: str) -> nn.Module:
    cfg = compose_config(["experiment=smoke", "model.roi_heads.score_thresh=0.0", *overrides], tmp_path)
    torch.manual_seed(0)
    module = instantiate(cfg.model, num_classes=4)
    module.configure_model()
    return smooth_activations(module).eval()


def test_a_model_predicts_the_same_masks_with_the_switch_on_and_off(tmp_path: Path) -> None:
    assert "speedups" in IMPLEMENTATION_HPARAMS  # a run resumes or is scored under either value
    switched = _module(tmp_path)
    plain = _module(tmp_path, "speedups.binary_mask_paste=null")
    assert type(switched.model.transform) is BinaryMaskTransform
    assert type(plain.model.transform) is GeneralizedRCNNTransform
    gen = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=gen) for _ in range(2)]
    with torch.no_grad():
        fast, reference = switched(images), plain(images)
    assert sum(len(d["masks"]) for d in fast) > 10
    for got, expected in zip(fast, reference):
        assert got.keys() == expected.keys() and got["masks"].dtype == torch.bool
        for key in got:
            assert torch.equal(got[key], expected[key]), key
    for module in (switched, plain):  # a threshold changed after construction applies to the next call
        module.evaluation_settings = dataclasses.replace(module.evaluation_settings, mask_threshold=0.8)
    with torch.no_grad():
        fast, reference = switched(images), plain(images)
    assert all(torch.equal(a["masks"], b["masks"]) for a, b in zip(fast, reference))
    assert sum(int(d["masks"].sum()) for d in fast) > 0


def test_nothing_is_switched_for_a_detector_without_masks_or_with_its_own_transform(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    faster = _module(tmp_path, "model.mask=false")
    assert type(faster.model.transform) is GeneralizedRCNNTransform
    detector = _module(tmp_path, "speedups.binary_mask_paste=null").model

    class OwnTransform(GeneralizedRCNNTransform):
        pass

    detector.transform = OwnTransform(64, 64, [0.5] * 3, [0.2] * 3)
    assert not use_binary_mask_paste(detector, 0.5) and type(detector.transform) is OwnTransform
    cfg = compose_config(["experiment=smoke"], tmp_path)

    from lit_amp_det import MaskRCNNModule

    class OwnModel(MaskRCNNModule):
        def build_model(self) -> nn.Module:
            built = super().build_model()
            built.transform = OwnTransform(64, 64, [0.5] * 3, [0.2] * 3)
            return built

    class OptedIn(OwnModel):
        def model_transforms(self) -> list:
            return list(self.configured_speedups)

    with caplog.at_level(logging.INFO, logger="lit_amp_det.models.speedups"):
        module = OptedIn(
            num_classes=4,
            **{
                k: v for k, v in instantiate(cfg.model, _partial_=True).keywords.items() if k != "num_classes"
            },
        )
        module.configure_model()
    assert type(module.model.transform) is OwnTransform
    assert (
        "speedups.binary_mask_paste: the detector has no mask head or not torchvision's "
        "transform (OwnTransform)" in caplog.text
    )

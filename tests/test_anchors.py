"""Anchors stay fp32 under mixed precision (torchvision's generator rounds them to the feature maps' half
dtype).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.image_list import ImageList

from conftest import compose_config
from lit_amp_det.models.anchors import FullPrecisionAnchorGenerator

SIZES = ((32,), (64,), (128,), (256,), (512,))
RATIOS = ((0.5, 1.0, 2.0),) * 5


def _inputs(dtype: torch.dtype, height: int = 800, width: int = 1344) -> tuple[ImageList, list[torch.Tensor]]:
    """A padded COCO-size batch of two images and its five FPN levels (strides 4 to 64)."""
    images = ImageList(torch.zeros(2, 3, height, width, dtype=dtype), [(800, 1333), (790, 1200)])
    maps = [torch.zeros(2, 8, height // s, width // s, dtype=dtype) for s in (4, 8, 16, 32, 64)]
    return images, maps


def test_fp32_feature_maps_give_torchvision_anchors_bit_for_bit() -> None:
    ours, theirs = FullPrecisionAnchorGenerator(SIZES, RATIOS), AnchorGenerator(SIZES, RATIOS)
    for dtype in (torch.float32, torch.float64):
        got, expected = ours(*_inputs(dtype)), theirs(*_inputs(dtype))
        assert len(got) == len(expected) == 2
        for a, b in zip(got, expected):
            assert a.dtype == dtype and torch.equal(a, b)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_feature_maps_give_the_fp32_anchors(half: torch.dtype) -> None:
    reference = AnchorGenerator(SIZES, RATIOS)(*_inputs(torch.float32))
    generator = FullPrecisionAnchorGenerator(SIZES, RATIOS)
    got = generator(*_inputs(half))
    for a, b in zip(got, reference):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    assert all(cell.dtype == torch.float32 for cell in generator.cell_anchors)
    # what torchvision's generator does with the same maps: anchors in the half dtype; torchvision's anchors
    # are integers, exact in fp16 below 2048, while bf16 rounds the shift and then the sum (8 bits: 8 px
    # steps)
    rounded = AnchorGenerator(SIZES, RATIOS)(*_inputs(half))[0]
    error = (rounded.float() - reference[0]).abs().max().item()
    assert rounded.dtype == half and error == (7.0 if half == torch.bfloat16 else 0.0), error


def test_torchvision_keeps_rounded_cell_anchors_after_a_half_call_and_ours_does_not() -> None:
    """torchvision converts ``cell_anchors`` in place: one bf16 call leaves later fp32 calls with rounded
    anchors where a cell anchor is not a bf16 number (here size 800, ratio 0.5: a half-width of 566 becomes
    568).
    """
    sizes = (*SIZES[:4], (800,))
    reference = AnchorGenerator(sizes, RATIOS)(*_inputs(torch.float32))[0]
    theirs, ours = AnchorGenerator(sizes, RATIOS), FullPrecisionAnchorGenerator(sizes, RATIOS)
    for generator in (theirs, ours):
        generator(*_inputs(torch.bfloat16))
    assert not torch.equal(theirs(*_inputs(torch.float32))[0], reference)
    assert torch.equal(ours(*_inputs(torch.float32))[0], reference)


def test_the_stand_in_allocates_nothing() -> None:
    from lit_amp_det.models.anchors import _fp32_stand_in

    stand_in = _fp32_stand_in(torch.zeros(2, 256, 200, 336, dtype=torch.bfloat16))
    assert stand_in.shape == (2, 256, 200, 336) and stand_in.dtype == torch.float32
    assert stand_in.untyped_storage().nbytes() == 4


def test_the_built_models_use_it_and_keep_their_state_dict_keys(tmp_path: Path) -> None:
    cfg = compose_config(["experiment=smoke"], tmp_path)
    module = instantiate(cfg.model, _convert_="all", num_classes=4)  # the data would set it
    assert type(module.model.rpn.anchor_generator) is FullPrecisionAnchorGenerator
    assert not any("anchor" in key for key in module.model.state_dict())
    images = [torch.rand(3, 64, 64)]
    module.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        image_list, _ = module.model.transform(images)
        features = list(module.model.backbone(image_list.tensors).values())
        assert features[0].dtype == torch.bfloat16
        anchors = module.model.rpn.anchor_generator(image_list, features)
    assert anchors[0].dtype == torch.float32

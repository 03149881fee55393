"""The Mask R-CNN on lit_amp_det's ops (``model.ops=ext``) against the same weights on torchvision's ops."""

from __future__ import annotations

import pytest
import torch
from torchvision.models.detection.roi_heads import RoIHeads

from hydra.utils import instantiate

from lit_amp_det.models.ext_ops import ExtRegionProposalNetwork, ExtRoIHeads, use_extension_ops
from lit_amp_det.models.maskrcnn import build_detector
from lit_amp_det.ops import MultiScaleRoIAlign
from conftest import compose_config
from ops_inputs import needs_extension

pytestmark = needs_extension

MODEL = dict(
    num_classes=7,
    backbone={"name": "resnet10", "fpn_channels": 32},
    transform={"min_size": 160, "max_size": 160},
    rpn={"anchor_sizes": [16, 32, 64, 128, 256], "pre_nms_top_n_test": 1000, "post_nms_top_n_test": 300},
    roi_heads={"box_head_width": 64, "mask_head_layers": [16], "score_thresh": 0.05, "detections_per_img": 50},
)


def _pair(seed: int = 0):
    """The same weights on both op backends. The score layers get a wide init: an untrained model's scores
    all sit near 0.5 (objectness) or 1/7 (classes), so fp32 ties would make the NMS order arbitrary
    (torchvision's batched_nms breaks ties by an unstable sort), and the comparison meaningless."""
    torch.manual_seed(seed)
    ext = build_detector(ops="ext", **MODEL)
    torch.nn.init.normal_(ext.rpn.head.cls_logits.weight, std=0.5)
    torch.nn.init.normal_(ext.roi_heads.box_predictor.cls_score.weight, std=0.5)
    plain = build_detector(ops="torchvision", **MODEL)
    plain.load_state_dict(ext.state_dict())
    return ext.eval(), plain.eval()


def test_ext_model_uses_the_extension_ops_and_keeps_state_dict_keys():
    ext, plain = _pair()
    assert type(ext.rpn) is ExtRegionProposalNetwork and type(ext.roi_heads) is ExtRoIHeads
    assert isinstance(ext.roi_heads.box_roi_pool, MultiScaleRoIAlign)
    assert isinstance(ext.roi_heads.mask_roi_pool, MultiScaleRoIAlign)
    assert type(plain.roi_heads) is RoIHeads
    assert list(ext.state_dict()) == list(plain.state_dict())


def test_same_detections_as_torchvision_on_the_validation_split():
    data = instantiate(compose_config().data)  # the embedded dataset, as `fit` uses it
    data.setup("validate")
    ext, plain = _pair()
    compared = 0
    with torch.no_grad():
        for images, _ in data.val_dataloader():
            images = [image.float() / 255 for image in images]  # the module's prepare_images does this in training
            for a, b in zip(ext(images), plain(images)):
                assert torch.equal(a["labels"], b["labels"])
                torch.testing.assert_close(a["boxes"], b["boxes"], rtol=0, atol=1e-4)
                torch.testing.assert_close(a["scores"], b["scores"], rtol=0, atol=1e-5)
                torch.testing.assert_close(a["masks"], b["masks"], rtol=0, atol=1e-4)
                compared += a["labels"].numel()
    assert compared > 100, "the untrained model should still emit many low-score detections to compare"


@pytest.mark.parametrize("autocast", [False, True])
def test_training_step_on_the_extension_ops(autocast):
    ext, plain = _pair()
    ext.train()
    plain.train()
    images = [torch.rand(3, 160, 160), torch.rand(3, 150, 140)]
    targets = [
        {"boxes": torch.tensor([[10.0, 20, 80, 90], [50, 50, 120, 110]]), "labels": torch.tensor([1, 3]),
         "masks": torch.zeros(2, 160, 160, dtype=torch.uint8)},
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
         "masks": torch.zeros(0, 150, 140, dtype=torch.uint8)},
    ]
    targets[0]["masks"][0, 20:90, 10:80] = 1
    targets[0]["masks"][1, 50:110, 50:120] = 1
    losses = {}
    for name, model in (("ext", ext), ("plain", plain)):
        torch.manual_seed(1)  # the samplers draw the same proposals
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            losses[name] = model(images, targets)
        total = sum(losses[name].values())
        assert torch.isfinite(total)
        total.backward()
    assert ext.backbone.body.conv1.weight.grad.abs().sum() > 0
    if not autocast:  # fp32: the two paths compute the same losses
        for key in losses["ext"]:
            torch.testing.assert_close(losses["ext"][key], losses["plain"][key], rtol=1e-4, atol=1e-5)


def test_use_extension_ops_refuses_a_subclassed_head():
    ext, _ = _pair()

    class MyHeads(RoIHeads):
        pass

    model = build_detector(ops="torchvision", **MODEL)
    model.roi_heads.__class__ = MyHeads
    with pytest.raises(TypeError, match="MyHeads"):
        use_extension_ops(model)
    assert use_extension_ops(ext) is ext  # converting twice is harmless

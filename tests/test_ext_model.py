"""The Mask R-CNN on lit_amp_det's ops (the ``ext_ops`` speedup) against the same weights on torchvision's
ops.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hydra.utils import instantiate
from torchvision.models.detection.roi_heads import RoIHeads

from conftest import compose_config
from lit_amp_det import ops
from lit_amp_det.models.ext_ops import ExtRegionProposalNetwork, ExtRoIHeads, use_extension_ops
from lit_amp_det.models.maskrcnn import build_detector
from lit_amp_det.ops import MultiScaleRoIAlign
from ops_inputs import needs_extension, random_boxes

pytestmark = needs_extension

MODEL = dict(
    num_classes=7,
    backbone={"name": "resnet10", "fpn_channels": 32},
    transform={"min_size": 160, "max_size": 160},
    rpn={"anchor_sizes": [16, 32, 64, 128, 256], "pre_nms_top_n_test": 1000, "post_nms_top_n_test": 300},
    roi_heads={
        "box_head_width": 64,
        "mask_head_layers": [16],
        "score_thresh": 0.05,
        "detections_per_img": 50,
    },
)


def _pair(seed: int = 0):
    """The same weights on both op backends. The score layers get a wide init: an untrained model's scores
    all sit near 0.5 (objectness) or 1/7 (classes), so fp32 ties would make the NMS order arbitrary
    (torchvision's batched_nms breaks ties by an unstable sort), and the comparison meaningless.
    """
    torch.manual_seed(seed)
    ext = use_extension_ops(build_detector(**MODEL))
    torch.nn.init.normal_(ext.rpn.head.cls_logits.weight, std=0.5)
    torch.nn.init.normal_(ext.roi_heads.box_predictor.cls_score.weight, std=0.5)
    plain = build_detector(**MODEL)
    plain.load_state_dict(ext.state_dict())
    return ext.eval(), plain.eval()


def test_ext_model_uses_the_extension_ops_and_keeps_state_dict_keys():
    ext, plain = _pair()
    assert type(ext.rpn) is ExtRegionProposalNetwork and type(ext.roi_heads) is ExtRoIHeads
    assert isinstance(ext.roi_heads.box_roi_pool, MultiScaleRoIAlign)
    assert isinstance(ext.roi_heads.mask_roi_pool, MultiScaleRoIAlign)
    assert type(plain.roi_heads) is RoIHeads
    assert list(ext.state_dict()) == list(plain.state_dict())


@pytest.mark.slow
def test_same_detections_as_torchvision_on_the_validation_split():
    data = instantiate(compose_config().data)  # the embedded dataset, as `fit` uses it
    data.setup("validate")
    ext, plain = _pair()
    compared = 0
    with torch.no_grad():
        for images, _ in data.val_dataloader():
            images = [
                image.float() / 255 for image in images
            ]  # the module's prepare_images does this in training
            for a, b in zip(ext(images), plain(images)):
                assert torch.equal(a["labels"], b["labels"])
                torch.testing.assert_close(a["boxes"], b["boxes"], rtol=0, atol=1e-4)
                torch.testing.assert_close(a["scores"], b["scores"], rtol=0, atol=1e-5)
                torch.testing.assert_close(a["masks"], b["masks"], rtol=0, atol=1e-4)
                compared += a["labels"].numel()
    assert compared > 100, "the untrained model should still emit many low-score detections to compare"


def _training_batch():
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, 160, 160, generator=g), torch.rand(3, 150, 140, generator=g)]
    targets = [
        {
            "boxes": torch.tensor([[10.0, 20, 80, 90], [50, 50, 120, 110]]),
            "labels": torch.tensor([1, 3]),
            "masks": torch.zeros(2, 160, 160, dtype=torch.uint8),
        },
        {
            "boxes": torch.zeros(0, 4),
            "labels": torch.zeros(0, dtype=torch.int64),
            "masks": torch.zeros(0, 150, 140, dtype=torch.uint8),
        },
    ]
    targets[0]["masks"][0, 20:90, 10:80] = 1
    targets[0]["masks"][1, 50:110, 50:120] = 1
    return images, targets


def _losses_and_gradient(model, autocast):
    """One training forward/backward: the loss values and every parameter's gradient as one float64 vector."""
    images, targets = _training_batch()
    model.train()
    model.zero_grad()
    torch.manual_seed(1)  # the samplers draw the same proposals
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        losses = model(images, targets)
    total = sum(losses.values())
    assert torch.isfinite(total)
    total.backward()
    grads = [p.grad.flatten().double() for p in model.parameters() if p.grad is not None]
    return {k: v.detach().float() for k, v in losses.items()}, torch.cat(grads)


def test_fp32_training_step_equals_torchvision_ops():
    ext, plain = _pair()
    (ext_losses, ext_grad), (plain_losses, plain_grad) = (
        _losses_and_gradient(m, False) for m in (ext, plain)
    )
    assert ext.backbone.body.conv1.weight.grad.abs().sum() > 0
    for key in ext_losses:
        torch.testing.assert_close(ext_losses[key], plain_losses[key], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ext_grad, plain_grad, rtol=1e-3, atol=1e-5)


def test_faster_rcnn_box_losses_are_torchvisions_training_branch():
    """Without a mask head the RoI heads train on the shared core's box losses: the numbers of torchvision's
    own training branch (``fastrcnn_loss``) on the same heads, up to float rounding.
    """
    torch.manual_seed(0)
    ext = use_extension_ops(build_detector(**MODEL, mask=False))
    reference = copy.deepcopy(ext)
    heads = reference.roi_heads
    heads.forward = lambda *args: RoIHeads.forward(heads, *args)  # torchvision's branch, same ops
    (losses, grad), (expected, expected_grad) = (_losses_and_gradient(m, False) for m in (ext, reference))
    assert losses.keys() == expected.keys() and "loss_box_reg" in losses
    for key in losses:
        torch.testing.assert_close(losses[key], expected[key], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)


def test_autocast_training_step_is_as_accurate_as_torchvision_ops():
    """Under bf16 autocast torchvision's RoIAlign upcasts to fp32 and ours pools natively in bf16, so the two
    differ by bf16 rounding; the gradient must stay as close to the fp32 one as torchvision's own is.
    """
    ext, plain = _pair()
    _, fp32_grad = _losses_and_gradient(copy.deepcopy(plain), False)
    ext_losses, ext_grad = _losses_and_gradient(ext, True)
    plain_losses, plain_grad = _losses_and_gradient(plain, True)
    for key in ("loss_objectness", "loss_rpn_box_reg"):  # the RPN runs before any RoIAlign: same numbers
        torch.testing.assert_close(ext_losses[key], plain_losses[key])
    for key in ("loss_classifier", "loss_box_reg", "loss_mask"):
        torch.testing.assert_close(ext_losses[key], plain_losses[key], rtol=0.1, atol=5e-3)
    assert torch.nn.functional.cosine_similarity(ext_grad, plain_grad, dim=0) > 0.98
    ext_error = (ext_grad - fp32_grad).norm() / fp32_grad.norm()
    plain_error = (plain_grad - fp32_grad).norm() / fp32_grad.norm()
    assert ext_error <= 1.1 * plain_error, (ext_error, plain_error)


def test_torch_export_of_the_models_extension_op_path():
    """``torch.export`` traces the ops through their fake kernels, data-dependent NMS output size included:
    the eval model's backbone, NMS of given proposals, multi-level pooling and box head export as one program
    that gives the same scores. (The whole eval model does not export, with either op set: torchvision's box
    decoding and per-detection mask pasting branch on data-dependent sizes; see the README.)
    """
    ext, _ = _pair()
    heads = ext.roi_heads

    class Scores(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone, self.pool, self.head, self.predictor = (
                ext.backbone,
                heads.box_roi_pool,
                heads.box_head,
                heads.box_predictor,
            )

        def forward(self, images, boxes, scores, labels):
            features = self.backbone(images)
            keep = ops.batched_nms(boxes, scores, labels, 0.5, max_output=50)
            pooled = self.pool(features, [boxes[keep]], [(images.shape[-2], images.shape[-1])])
            class_logits, _ = self.predictor(self.head(pooled))
            return class_logits.softmax(-1)

    g = torch.Generator().manual_seed(3)
    images = torch.rand(1, 3, 160, 192, generator=g)
    boxes = random_boxes(300, image=(160, 192), max_size=120, clusters=30, generator=g)
    scores, labels = torch.rand(300, generator=g), torch.randint(3, (300,), generator=g)
    model = Scores().eval()
    with torch.no_grad():
        expected = model(images, boxes, scores, labels)
        program = torch.export.export(model, (images, boxes, scores, labels), strict=False)
        got = program.module()(images, boxes, scores, labels)
    targets = {node.target for node in program.graph.nodes if node.op == "call_function"}
    assert {
        torch.ops.lit_amp_det.batched_nms.default,
        torch.ops.lit_amp_det.multi_level_roi_align.default,
    } <= targets
    torch.testing.assert_close(got, expected)


def test_use_extension_ops_refuses_a_subclassed_head():
    ext, _ = _pair()

    class MyHeads(RoIHeads):
        pass

    model = build_detector(**MODEL)
    heads = model.roi_heads
    model.roi_heads = MyHeads(
        heads.box_roi_pool, heads.box_head, heads.box_predictor, 0.5, 0.5, 512, 0.25, None, 0.05, 0.5, 100
    )
    with pytest.raises(TypeError, match="MyHeads"):
        use_extension_ops(model)
    assert use_extension_ops(ext) is ext  # converting twice is harmless

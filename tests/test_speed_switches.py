"""model.channels_last and model.compile: same results and state_dict, clear errors for bad values."""

from __future__ import annotations

import pytest
import torch
from conftest import CONFIG_ERRORS, compose_config
from hydra.utils import instantiate

from lit_amp_det import MaskRCNNModule
from lit_amp_det.models.speed import compile_detector


def _module(**overrides: object) -> MaskRCNNModule:
    cfg = compose_config(["experiment=smoke"])
    torch.manual_seed(0)
    return instantiate(cfg.model, _convert_="all", num_classes=4, **overrides)


def _images() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=gen) for _ in range(2)]


def test_channels_last_gives_the_same_detections_and_state_dict() -> None:
    plain, nhwc = _module(), _module(channels_last=True)
    nhwc.load_state_dict(plain.state_dict())
    assert list(nhwc.state_dict()) == list(plain.state_dict())
    conv = nhwc.model.backbone.body.conv1.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    seen = []
    nhwc.model.backbone.body.conv1.register_forward_pre_hook(
        lambda m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    plain.eval(), nhwc.eval()
    for module in (plain, nhwc):  # score layers wide enough that detections survive the thresholds
        torch.nn.init.normal_(module.model.roi_heads.box_predictor.cls_score.weight, std=0.5)
    nhwc.model.roi_heads.box_predictor.load_state_dict(plain.model.roi_heads.box_predictor.state_dict())
    with torch.no_grad():
        expected, actual = plain(_images()), nhwc(_images())
    assert seen == [True]
    for a, b in zip(expected, actual):
        assert a["boxes"].shape[0] > 0
        torch.testing.assert_close(b["boxes"], a["boxes"], atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(b["scores"], a["scores"], atol=1e-4, rtol=1e-4)


def test_compile_backbone_keeps_parameter_names_and_results() -> None:
    plain = _module()
    compiled = _module()
    compile_detector(compiled.model, "backbone", backend="eager")  # the compile path without inductor's build time
    assert list(compiled.state_dict()) == list(plain.state_dict())
    assert compiled.model.backbone._compiled_call_impl is not None
    plain.eval(), compiled.eval()
    with torch.no_grad():
        batch = torch.rand(2, 3, 64, 64)
        expected, actual = plain.model.backbone(batch), compiled.model.backbone(batch)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key])


@pytest.mark.parametrize("value", ["everything", "heads", True])
def test_unknown_compile_target_is_refused(value: object) -> None:
    with pytest.raises(CONFIG_ERRORS, match="compile="):
        _module(compile=value)

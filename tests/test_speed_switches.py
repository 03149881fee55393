"""The speedups (``conf/speedups``, :mod:`lit_amp_det.models.speedups`): each keeps the state_dict and the
results, applies only on the devices it declares, and a bad entry is refused naming it.
"""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from conftest import CONFIG_ERRORS, compose_config
from lit_amp_det import MaskRCNNModule
from lit_amp_det.models.speedups import (
    DEFAULT_SPEEDUPS,
    ChannelsLast,
    CompileBackbone,
    ExtensionOps,
    apply_transforms,
    build_transforms,
)

CHANNELS_LAST = {"_target_": "lit_amp_det.models.speedups.ChannelsLast"}


def _module(*overrides: str) -> MaskRCNNModule:
    cfg = compose_config(["experiment=smoke", *overrides])
    torch.manual_seed(0)
    module = instantiate(cfg.model, _convert_="all", num_classes=4)
    module.configure_model()
    return module


def _images() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8, generator=gen) for _ in range(2)]


def test_the_default_config_lists_the_python_defaults() -> None:
    cfg = compose_config([])
    listed = {k: dict(v) for k, v in cfg.speedups.items() if v is not None}
    assert listed == DEFAULT_SPEEDUPS
    assert _module().applied_speedups == ["ext_ops", "binary_mask_paste"]
    assert _module("speedups=none").applied_speedups == []


def test_channels_last_gives_the_same_detections_and_state_dict() -> None:
    plain = _module()
    nhwc = _module("speedups.channels_last={_target_:lit_amp_det.models.speedups.ChannelsLast}")
    assert nhwc.applied_speedups == ["ext_ops", "binary_mask_paste", "channels_last"]
    nhwc.load_state_dict(plain.state_dict())
    assert list(nhwc.state_dict()) == list(plain.state_dict())
    conv = nhwc.model.backbone.body.conv1.weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    seen = []
    nhwc.model.backbone.body.conv1.register_forward_pre_hook(
        lambda m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
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
    CompileBackbone(backend="eager")(compiled.model)  # the compile path without inductor's build time
    assert list(compiled.state_dict()) == list(plain.state_dict())
    assert compiled.model.backbone._compiled_call_impl is not None
    plain.eval(), compiled.eval()
    with torch.no_grad():
        batch = torch.rand(2, 3, 64, 64)
        expected, actual = plain.model.backbone(batch), compiled.model.backbone(batch)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key])


def test_a_transform_applies_only_on_the_devices_it_declares() -> None:
    module = _module("speedups=none")
    model, applied = apply_transforms(module.model, [ChannelsLast(devices=["cuda"]), ExtensionOps()], "cpu")
    assert applied == ["ext_ops"]
    assert model.backbone.body.conv1.weight.is_contiguous()  # channels_last was for CUDA only
    assert ChannelsLast(devices=["cuda"]).applies_to(torch.device("cuda", 0))


def test_the_gpu_option_adds_channels_last_and_compile_on_cuda_only() -> None:
    transforms = build_transforms(compose_config(["speedups=gpu"]).speedups)
    assert [t.name for t in transforms] == [
        "ext_ops",
        "binary_mask_paste",
        "sync_free",
        "channels_last",
        "compile",
    ]
    assert [t.devices for t in transforms[2:]] == [("cuda",), ("cuda",), ("cuda",)]
    assert _module("speedups=gpu").applied_speedups == ["ext_ops", "binary_mask_paste"]  # on this CPU


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ("speedups.channels_last=true", "speedups.channels_last=True must be a _target_ mapping"),
        (
            "speedups.ext_ops={_target_:torch.nn.Identity}",
            "speedups.ext_ops._target_='torch.nn.Identity' made a Identity",
        ),
        (
            "speedups.channels_last={_target_:lit_amp_det.models.speedups.ChannelsLast,devices:[tpu]}",
            r"speedups.channels_last.devices=\[.*tpu.*\] must list device types",
        ),
    ],
)
def test_bad_entries_are_refused_naming_them(entry: str, match: str) -> None:
    with pytest.raises(CONFIG_ERRORS, match=match):
        _module(entry)


@pytest.mark.parametrize(
    "overrides",
    [
        ["speedups.ext_ops=null"],
        ["+speedups.ext_ops.devices=[cuda]"],
    ],
)
def test_sync_free_asks_for_the_extension_ops_instead_of_applying_them(overrides: list[str]) -> None:
    """The fixed-shape heads are lit_amp_det's heads: without ``speedups.ext_ops`` on the same device,
    ``sync_free`` names both settings instead of applying the ops itself.
    """
    on_cpu = "speedups.sync_free.devices=[cpu,cuda]"
    with pytest.raises(ValueError, match=r"speedups\.sync_free") as refused:
        _module(on_cpu, *overrides)
    assert "speedups.ext_ops" in str(refused.value)
    assert _module(on_cpu).applied_speedups == ["ext_ops", "binary_mask_paste", "sync_free"]

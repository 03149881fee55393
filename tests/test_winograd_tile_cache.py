"""model.winograd_weight_tile_cache: a Winograd layer keeps its weight's tiles between calls that build no graph,
bit for bit the uncached result, and never serves tiles of a weight that changed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import compose_config
from hydra.utils import instantiate
from torch import nn

import lit_amp_det.models.winograd_conv as winograd_conv
from lit_amp_det.models.winograd_conv import WeightTileCache, WinogradConv2d, use_winograd_convs, winograd_conv3x3
from lit_amp_det.ops._extension import extension_available

pytestmark = pytest.mark.skipif(not extension_available(), reason="the compiled extension is not built")
NHWC = torch.channels_last


def _layer(output_tile: int, cache: bool = True, seed: int = 0) -> WinogradConv2d:
    """A 64 -> 64 layer that takes Winograd in fp32 on 32x32 maps (256 2x2 tiles: F(4x4) where asked)."""
    torch.manual_seed(seed)
    holder = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1))
    use_winograd_convs(holder, [], output_tile)  # no part named: nothing switched
    conv = holder[0]
    conv.__class__ = WinogradConv2d
    conv.output_tile = output_tile
    conv.weight_tile_cache = WeightTileCache() if cache else None
    return conv.to(memory_format=NHWC)


def _input(seed: int = 1) -> torch.Tensor:
    return torch.randn(1, 64, 32, 32, generator=torch.Generator().manual_seed(seed)).contiguous(memory_format=NHWC)


@pytest.fixture
def transforms(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the weight-tile transforms the layers run (the module's name the cache and the convolution call)."""
    calls: list[int] = []
    real = winograd_conv.winograd_weight_tiles

    def counting(weight, *args, **kwargs):
        calls.append(weight.shape[0])
        return real(weight, *args, **kwargs)

    monkeypatch.setattr(winograd_conv, "winograd_weight_tiles", counting)
    return calls


@pytest.mark.parametrize("output_tile", [2, 4])
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_kept_tiles_give_the_uncached_result_bit_for_bit(output_tile: int, mode: str, transforms: list[int]) -> None:
    cached, plain = _layer(output_tile), _layer(output_tile, cache=False)
    x = _input()
    context = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with context():
        expected = plain(x)
        first, second = cached(x), cached(_input(2))
        assert cached.computes_with_winograd(x) and cached.tile_side(x) == output_tile
    assert len(transforms) == 2  # the plain layer's and the cache's first call; the second call reused them
    assert torch.equal(first, expected)
    with torch.no_grad():
        torch.testing.assert_close(second, F.conv2d(_input(2), cached.weight, cached.bias, padding=1),
                                   rtol=1e-4, atol=1e-4)
    assert cached.weight_tile_cache.nbytes == {2: 16, 4: 36}[output_tile] * 64 * 64 * 4


def test_a_changed_weight_gets_new_tiles(transforms: list[int]) -> None:
    """In-place updates (an optimizer step, load_state_dict) count up the weight's version; a new tensor behind
    the parameter (``.data =``) has another address while the cache holds the old one."""
    conv = _layer(4)
    x = _input()

    def call() -> torch.Tensor:
        with torch.inference_mode():
            out = conv(x)
        with torch.no_grad():  # the uncached computation with the weight as it is now, bit for bit
            assert torch.equal(out, winograd_conv3x3(x, conv.weight, conv.bias, output_tile=4))
            expected = F.conv2d(x, conv.weight, conv.bias, padding=1)
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
        return out

    call()
    with torch.no_grad():
        conv.weight.mul_(-0.5)
    call()
    conv.load_state_dict({"weight": torch.randn(64, 64, 3, 3), "bias": torch.zeros(64)})
    call()
    conv.weight.data = torch.randn(64, 64, 3, 3).contiguous(memory_format=NHWC)
    call()
    call()
    assert len(transforms) == 4 + 5  # the cache's four, and the uncached reference's every call


def test_training_calls_drop_the_tiles_and_never_use_them(transforms: list[int]) -> None:
    conv = _layer(4)
    x = _input()
    with torch.no_grad():
        conv(x)
    assert conv.weight_tile_cache.nbytes > 0
    out = conv(x.requires_grad_())
    assert out.grad_fn is not None and conv.weight_tile_cache.nbytes == 0
    out.square().sum().backward()
    assert conv.weight.grad is not None and x.grad is not None
    assert len(transforms) == 3  # cached once, then the training call's forward and backward (transposed) tiles


def test_other_weights_and_autocast_are_not_cached(transforms: list[int]) -> None:
    """A weight that is not the layer's parameter (conv-BN eval's folded one, made anew each call) and an autocast
    call (which casts the weight each call) take the uncached path; the result is the plain layer's."""
    conv, plain = _layer(2), _layer(2, cache=False)
    x = _input()
    folded = conv.weight * 0.5
    with torch.inference_mode():
        torch.testing.assert_close(conv.convolve(x, folded, None), plain.convolve(x, folded, None), rtol=0, atol=0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            conv(x)
    assert conv.weight_tile_cache.nbytes == 0


def test_weights_made_in_inference_mode_are_not_cached() -> None:
    """Inference tensors have no version counter to check: such a layer computes uncached."""
    with torch.inference_mode():
        conv = _layer(2)
        out = conv(_input())
    assert conv.weight.is_inference() and conv.weight_tile_cache.nbytes == 0
    torch.testing.assert_close(out, _layer(2, cache=False)(_input()).detach(), rtol=0, atol=0)


def test_the_config_switch_reaches_the_layers() -> None:
    overrides = ["model=maskrcnn_tiny", "model.winograd_convs=[mask_head,fpn]"]
    module = instantiate(compose_config([*overrides, "model.winograd_weight_tile_cache=true"]).model, num_classes=3)
    layers = [m for m in module.modules() if isinstance(m, WinogradConv2d)]
    assert layers and all(isinstance(m.weight_tile_cache, WeightTileCache) for m in layers)
    plain = instantiate(compose_config(overrides).model, num_classes=3)
    assert all(m.weight_tile_cache is None for m in plain.modules() if isinstance(m, WinogradConv2d))

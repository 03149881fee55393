"""``examples/weighted_loss.py``, the research subclass the README points to, does what it says: its GroupNorm
mask head is the model that trains, with the configured speedups it opts back into, and its loss weights
apply. (It trains from the CLI in ``tests/test_cli.py``.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lit_amp_det.models.ext_ops import ExtRoIHeads

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def weighted_loss(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    monkeypatch.delitem(sys.modules, "weighted_loss", raising=False)
    import weighted_loss

    return weighted_loss


def _module(weighted_loss, **speedups):
    return weighted_loss.WeightedLossMaskRCNN(
        4,
        backbone={"name": "resnet10", "fpn_channels": 32},
        roi_heads={"mask_head_layers": [16, 16]},
        loss_weights={"loss_mask": 2.0},
        speedups=speedups or None,
    )


def test_the_groupnorm_head_gets_the_configured_speedups(weighted_loss) -> None:
    module = _module(weighted_loss)
    module.configure_model()  # on its CPU device, as Lightning would call it
    assert module.applied_speedups == ["ext_ops", "binary_mask_paste"]  # the defaults, opted back into
    assert isinstance(module.model.roi_heads, ExtRoIHeads)
    head = module.model.roi_heads.mask_head
    assert [type(block[1]) for block in head] == [nn.GroupNorm, nn.GroupNorm]
    plain = _module(weighted_loss, ext_ops=None)
    plain.configure_model()
    assert plain.applied_speedups == []


def test_the_loss_weights_scale_their_terms_only(weighted_loss) -> None:
    module = _module(weighted_loss)
    losses = {"loss_mask": torch.tensor(1.5), "loss_classifier": torch.tensor(0.25, dtype=torch.bfloat16)}
    assert module.compute_loss(losses).item() == pytest.approx(2.0 * 1.5 + 0.25)

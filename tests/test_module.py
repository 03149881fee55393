"""MaskRCNNModule: steps, fp32 predictions, override points, weight loading."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate

from lit_amp_det import MaskRCNNModule

from conftest import CONFIG_ERRORS, compose_config


def _tiny(tmp_path: Path, *overrides: str) -> MaskRCNNModule:
    cfg = compose_config(["experiment=smoke", *overrides], tmp_path)
    return instantiate(cfg.model, num_classes=4, category_ids=[10, 20, 30])


def _batch(n: int = 2, size: int = 64) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=gen) for _ in range(n)]
    targets = []
    for i in range(n):
        masks = torch.zeros(2, size, size, dtype=torch.uint8)
        masks[0, 5:30, 8:40] = 1
        masks[1, 30:60, 20:50] = 1
        targets.append({
            "boxes": torch.tensor([[8.0, 5.0, 40.0, 30.0], [20.0, 30.0, 50.0, 60.0]]),
            "labels": torch.tensor([1, 3]),
            "masks": masks,
            "iscrowd": torch.tensor([0, 1]),
            "area": torch.tensor([800.0, 900.0]),
            "image_id": torch.tensor(i + 1),
        })
    return images, targets


def test_training_loss_is_finite_and_crowd_is_ignored(tmp_path: Path) -> None:
    module = _tiny(tmp_path)
    images, targets = _batch()
    seen = []
    module.model.roi_heads.register_forward_pre_hook(lambda m, args: seen.append(args[3]))
    module.train()
    loss = module.compute_loss(module.model(module.prepare_images(images), module.training_targets(targets)))
    assert loss.ndim == 0 and torch.isfinite(loss)
    assert [len(t["boxes"]) for t in seen[0]] == [1, 1]  # the crowd instance never reaches the heads
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())


def test_predictions_are_fp32_with_boolean_masks(tmp_path: Path) -> None:
    module = _tiny(tmp_path, "model.roi_heads.score_thresh=0.0").eval()
    images, targets = _batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = module.predict_step((images, targets), 0)
    assert len(outputs) == 2 and outputs[0]["image_id"] == 1
    for out in outputs:
        assert out["boxes"].dtype == torch.float32 and out["scores"].dtype == torch.float32
        assert out["masks"].dtype == torch.bool and out["masks"].shape[1:] == (64, 64)
        assert set(out["category_ids"].tolist()) <= {10, 20, 30}
    assert sum(len(o["boxes"]) for o in outputs) > 0


def test_validation_computes_coco_map(tmp_path: Path) -> None:
    module = _tiny(tmp_path).eval()
    images, targets = _batch()
    logged = {}
    module.log_dict = lambda values, **kw: logged.update(values)  # capture without a Trainer
    module._trainer = SimpleNamespace(sanity_checking=False, global_step=5)
    with torch.no_grad():
        module.validation_step((images, targets), 0)
    module.on_validation_epoch_end()
    assert module.last_validated_step == 5
    for key in ("val/bbox_mAP", "val/bbox_mAP_50", "val/segm_mAP", "val/segm_mAP_50"):
        assert key in logged and 0.0 <= float(logged[key]) <= 1.0


def test_faster_rcnn_switch(tmp_path: Path) -> None:
    module = _tiny(tmp_path, "model.mask=false").eval()
    assert module.model.roi_heads.mask_head is None
    with torch.no_grad():
        out = module(_batch()[0])
    assert "masks" not in out[0]


class _HalfMaskLoss(MaskRCNNModule):
    def compute_loss(self, loss_dict):
        self.seen_keys = sorted(loss_dict)
        return sum(v * (0.5 if k == "loss_mask" else 1.0) for k, v in loss_dict.items())


def test_subclass_override_points_are_used(tmp_path: Path) -> None:
    cfg = compose_config(["experiment=smoke", f"model._target_={__name__}._HalfMaskLoss"], tmp_path)
    module = instantiate(cfg.model, num_classes=4)
    assert type(module) is _HalfMaskLoss
    module.log = module.log_dict = lambda *a, **k: None
    module.optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.1)
    module.train()
    module.training_step(_batch(), 0)
    assert module.seen_keys == ["loss_box_reg", "loss_classifier", "loss_mask", "loss_objectness", "loss_rpn_box_reg"]


def test_weights_load_from_state_dict_and_lightning_checkpoint(tmp_path: Path) -> None:
    source = _tiny(tmp_path)
    raw = tmp_path / "model.pt"
    torch.save(source.model.state_dict(), raw)
    lightning_ckpt = tmp_path / "module.ckpt"
    torch.save({"state_dict": source.state_dict(), "hyper_parameters": dict(source.hparams)}, lightning_ckpt)
    for path in (raw, lightning_ckpt):
        loaded = _tiny(tmp_path, f"model.checkpoint={path}")
        for key, value in source.model.state_dict().items():
            assert torch.equal(value, loaded.model.state_dict()[key]), key


def test_mismatched_heads_need_checkpoint_strict_false(tmp_path: Path) -> None:
    source = _tiny(tmp_path)
    path = tmp_path / "model.pt"
    torch.save(source.model.state_dict(), path)
    cfg = compose_config(["experiment=smoke", f"model.checkpoint={path}"], tmp_path)
    with pytest.raises(CONFIG_ERRORS, match="checkpoint_strict=false"):
        instantiate(cfg.model, num_classes=6)
    cfg = compose_config(["experiment=smoke", f"model.checkpoint={path}", "model.checkpoint_strict=false"], tmp_path)
    module = instantiate(cfg.model, num_classes=6)
    trunk = "backbone.body.layer1.0.conv1.weight"
    assert torch.equal(module.model.state_dict()[trunk], source.model.state_dict()[trunk])


def test_unsafe_or_missing_checkpoints_are_refused(tmp_path: Path) -> None:
    pickled = tmp_path / "code.pt"
    torch.save({"state_dict": {"x": torch.zeros(1)}, "fn": _HalfMaskLoss}, pickled)
    with pytest.raises(CONFIG_ERRORS, match="could not be loaded with weights_only=True"):
        _tiny(tmp_path, f"model.checkpoint={pickled}")
    with pytest.raises(CONFIG_ERRORS, match="does not exist"):
        _tiny(tmp_path, f"model.checkpoint={tmp_path / 'nope.pt'}")



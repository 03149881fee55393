"""Bad checkpoints as a new user meets them: one message naming the file, what is wrong and what to pass.

Both ways a checkpoint enters are covered: ``model.weights=PATH`` (loaded by the module's constructor,
inside Hydra's ``instantiate``) and ``ckpt_path=FILE`` (checked by ``check_checkpoint`` before Lightning
restores it). Checkpoints are real Lightning ones, written by ``Trainer.save_checkpoint`` from a tiny model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hydra.utils import instantiate

from conftest import CONFIG_ERRORS, compose_config, run_cli
from lit_amp_det import MaskRCNNModule
from lit_amp_det.checkpoints import check_checkpoint

R18 = "model.backbone.name=resnet18"


def _module(*overrides: str, num_classes: int = 7) -> MaskRCNNModule:
    cfg = compose_config(["experiment=smoke", *overrides])
    return instantiate(cfg.model, num_classes=num_classes)


def _message(call: Callable[[], object]) -> str:
    """The text a checkpoint error shows (through Hydra's wrapper when the constructor raised it)."""
    with pytest.raises((*CONFIG_ERRORS, RuntimeError)) as info:
        call()
    return str(info.value)


def _assert_no_key_dump(message: str) -> None:
    assert "Missing key(s)" not in message and "Unexpected key(s)" not in message
    assert message.count(".weight") + message.count(".bias") <= 3, message
    assert len(message) < 900, message


@pytest.fixture(scope="module")
def r18_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Lightning checkpoint of the tiny Mask R-CNN on ResNet-18 with 7 classes (6 + background)."""
    path = tmp_path_factory.mktemp("ckpt") / "r18.ckpt"
    trainer = pl.Trainer(
        logger=False,
        enable_checkpointing=False,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.strategy.connect(_module(R18))
    trainer.save_checkpoint(path)
    return path


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.ckpt"
    path.write_bytes(b"")
    for message in (
        _message(lambda: _module(f"model.weights={path}")),
        _message(lambda: check_checkpoint(str(path), _module())),
    ):
        assert (
            str(path) in message and "is empty (0 bytes)" in message and "pass another checkpoint" in message
        )
        assert "EOFError" not in message


def test_garbage_bytes(tmp_path: Path) -> None:
    path = tmp_path / "notes.ckpt"
    path.write_bytes(b"these are my training notes, not weights\n" * 20)
    for message in (
        _message(lambda: _module(f"model.weights={path}")),
        _message(lambda: check_checkpoint(str(path), _module())),
    ):
        assert str(path) in message and "is not a PyTorch checkpoint" in message
        assert "torch.save(model.state_dict(), path)" in message
        assert (
            "In PyTorch 2.6" not in message and "add_safe_globals" not in message
        )  # torch's weights_only text


def test_truncated_checkpoint(r18_ckpt: Path, tmp_path: Path) -> None:
    path = tmp_path / "copied_halfway.ckpt"
    data = r18_ckpt.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    for message in (
        _message(lambda: _module(R18, f"model.weights={path}")),
        _message(lambda: check_checkpoint(str(path), _module(R18))),
    ):
        assert (
            str(path) in message
            and "is truncated or corrupted" in message
            and "Use a complete copy" in message
        )
        assert "PytorchStreamReader" not in message and "miniz" not in message


def test_directory(r18_ckpt: Path) -> None:
    folder = r18_ckpt.parent
    for message in (
        _message(lambda: _module(f"model.weights={folder}")),
        _message(lambda: check_checkpoint(str(folder), _module())),
    ):
        assert f"{str(folder)!r} is a directory" in message
        assert f"pass the checkpoint file inside it, e.g. {str(r18_ckpt)!r}" in message


def test_r18_checkpoint_into_r34(r18_ckpt: Path) -> None:
    configured = ("model.backbone.name=resnet34",)
    for message in (
        _message(lambda: _module(*configured, f"model.weights={r18_ckpt}")),
        _message(lambda: check_checkpoint(str(r18_ckpt), _module(*configured))),
    ):
        assert str(r18_ckpt) in message
        assert "model.backbone.name=resnet18 in the checkpoint, resnet34 configured" in message
        assert "pass model.backbone.name=resnet18" in message
        _assert_no_key_dump(message)
    check_checkpoint(
        str(r18_ckpt), _module(R18, "model.roi_heads.score_thresh=0.3")
    )  # the fix; thresholds may differ


def test_mask_rcnn_checkpoint_into_faster_rcnn(r18_ckpt: Path) -> None:
    configured = (R18, "model.mask=false")
    for message in (
        _message(lambda: _module(*configured, f"model.weights={r18_ckpt}")),
        _message(lambda: check_checkpoint(str(r18_ckpt), _module(*configured))),
    ):
        assert str(r18_ckpt) in message
        assert (
            "model.mask=true in the checkpoint, false configured" in message
            and "pass model.mask=true" in message
        )
        _assert_no_key_dump(message)


def test_seven_class_checkpoint_into_four_classes(r18_ckpt: Path, caplog: pytest.LogCaptureFixture) -> None:
    message = _message(lambda: check_checkpoint(str(r18_ckpt), _module(R18, num_classes=4)))
    assert "was made with model.num_classes=7, 4 configured" in message
    assert f"start a new run with model.weights={str(r18_ckpt)!r} instead of ckpt_path" in message
    _assert_no_key_dump(message)

    # as model.weights it fine-tunes: no switch, one log line, the class-dependent layers start fresh
    with caplog.at_level(logging.WARNING, logger="lit_amp_det.checkpoints"):
        module = _module(R18, f"model.weights={r18_ckpt}", num_classes=4)
    (record,) = [r for r in caplog.records if r.name == "lit_amp_det.checkpoints"]
    line = record.getMessage()
    assert "\n" not in line and str(r18_ckpt) in line
    assert (
        "made for another class count; 6 class-dependent predictor tensors keep their fresh initialisation"
        in line
    )
    assert "roi_heads.box_predictor.cls_score.weight" in line
    saved = torch.load(r18_ckpt, map_location="cpu", weights_only=True)["state_dict"]
    own = module.model.state_dict()
    assert sorted(k for k in own if own[k].shape != saved[f"model.{k}"].shape) == [
        "roi_heads.box_predictor.bbox_pred.bias",
        "roi_heads.box_predictor.bbox_pred.weight",
        "roi_heads.box_predictor.cls_score.bias",
        "roi_heads.box_predictor.cls_score.weight",
        "roi_heads.mask_predictor.mask_fcn_logits.bias",
        "roi_heads.mask_predictor.mask_fcn_logits.weight",
    ]
    for key, value in own.items():
        if value.shape == saved[f"model.{key}"].shape:
            assert torch.equal(value, saved[f"model.{key}"]), key


def test_another_class_count_does_not_excuse_another_architecture(r18_ckpt: Path) -> None:
    message = _message(
        lambda: _module("model.backbone.name=resnet34", f"model.weights={r18_ckpt}", num_classes=4)
    )
    assert str(r18_ckpt) in message
    assert "model.backbone.name=resnet18 in the checkpoint, resnet34 configured" in message
    assert "pass model.backbone.name=resnet18" in message
    _assert_no_key_dump(message)


@pytest.mark.slow
def test_cli_prints_the_message_not_hydras_wrapper_or_lightnings_key_list(
    r18_ckpt: Path, tmp_path: Path
) -> None:
    truncated = tmp_path / "last.ckpt"
    truncated.write_bytes(r18_ckpt.read_bytes()[:4096])
    user_env = {"HYDRA_FULL_ERROR": "0"}  # what a user sees
    proc = run_cli(
        ["validate", "experiment=smoke", f"model.weights={truncated}"],
        cwd=tmp_path,
        env=user_env,
        check=False,
    )
    assert proc.returncode != 0
    assert f"lit_amp_det: model.weights={str(truncated)!r} is truncated or corrupted" in proc.stderr
    assert (
        "PytorchStreamReader" not in proc.stderr and "Traceback" not in proc.stderr
    )  # the traceback: in the log

    proc = run_cli(
        ["validate", "experiment=smoke", "model.backbone.name=resnet34", f"ckpt_path={r18_ckpt}"],
        cwd=tmp_path,
        env=user_env,
        check=False,
    )
    assert proc.returncode != 0
    assert (
        f"ckpt_path={str(r18_ckpt)!r} was made for another model: model.backbone.name=resnet18 in the "
        "checkpoint, resnet34 configured"
    ) in proc.stderr
    assert "Missing key(s)" not in proc.stderr and "Unexpected key(s)" not in proc.stderr

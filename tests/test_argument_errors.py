"""Library classes name their own argument in an error; the command line names the config path of the same
value.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import open_dict

from conftest import SMOKE, compose_config
from lit_amp_det.app.tasks import build_datamodule, build_model, build_trainer, config_node
from lit_amp_det.callbacks.memory_monitor import MemoryMonitor
from lit_amp_det.data.datamodule import CocoDataModule
from lit_amp_det.errors import ArgumentError


def test_message_names_the_argument_and_the_prefix_goes_in_front() -> None:
    err = ArgumentError("backbone.name", "resnet9", "is unknown; choose one of ['resnet18']")
    assert str(err) == "backbone.name='resnet9' is unknown; choose one of ['resnet18']"
    assert isinstance(err, ValueError)  # code catching ValueError keeps working
    moved = err.at("model")
    assert str(moved) == "model.backbone.name='resnet9' is unknown; choose one of ['resnet18']"
    assert (moved.argument, moved.value, moved.problem) == ("model.backbone.name", "resnet9", err.problem)
    assert str(pickle.loads(pickle.dumps(moved))) == str(moved)  # crosses process boundaries intact


def test_config_node_prefixes_only_argument_errors() -> None:
    with (
        pytest.raises(ArgumentError, match=r"^callbacks\.x\.steps=0 "),
        config_node("callbacks.x"),
    ):
        raise ArgumentError("steps", 0, "must be >= 1")
    with pytest.raises(RuntimeError, match="^unrelated$"), config_node("callbacks.x"):
        raise RuntimeError("unrelated")


def test_library_classes_name_their_argument() -> None:
    with pytest.raises(ArgumentError, match=r"^predict_split='dev' .*train, val or test"):
        CocoDataModule(root="/nonexistent", predict_split="dev")
    with pytest.raises(ArgumentError, match=r"^bad_images='ignore' .*error or skip"):
        CocoDataModule(root="/nonexistent", bad_images="ignore")
    with pytest.raises(ArgumentError, match=r"^warmup_steps=-1 "):
        MemoryMonitor(warmup_steps=-1)


@pytest.mark.parametrize(
    ("override", "build", "message"),
    [
        ("data.predict_split=dev", "data", r"^data\.predict_split='dev' is unknown"),
        (
            "callbacks.freeze_norm.frozen_stages=7",
            "trainer",
            r"^callbacks\.freeze_norm\.frozen_stages=7 must be",
        ),
        (
            "model.evaluation.mask_threshold=1.5",
            "model",
            r"^model\.evaluation\.mask_threshold=1\.5 ",
        ),
        (
            "+model.evaluation.threshold=0.4",
            "model",
            r"^model\.evaluation=\{.*\} has unknown keys \['threshold'\]",
        ),
        # model.optim and model.speedups read the top-level groups, whose keys are the ones a user can
        # override
        ("optim.reference_batch=0", "model", r"^optim\.reference_batch=0 "),
        ("optim.optimizer._target_=null", "model", r"^optim\.optimizer=\{.*\} needs a _target_"),
        ("speedups.ext_ops=true", "model", r"^speedups\.ext_ops=True .*_target_"),
        (
            "+speedups.mine={_target_:torch.nn.Identity}",
            "model",
            r"^speedups\.mine\._target_='torch\.nn\.Identity' made",
        ),
        # ... unless the model node was given its own value
        (
            "model.optim={reference_batch:0}",
            "model",
            r"^model\.optim\.reference_batch=0 ",
        ),
    ],
)
def test_the_command_line_names_the_config_path(
    tmp_path: Path, override: str, build: str, message: str
) -> None:
    groups = ["callbacks=[default,freeze_norm]"] if "freeze_norm" in override else []
    cfg = compose_config([*SMOKE, *groups, override], tmp_path)
    builders = {
        "data": build_datamodule,
        "trainer": build_trainer,
        "model": lambda cfg: build_model(cfg, SimpleNamespace(num_classes=4)),
    }
    with pytest.raises(ArgumentError, match=message):
        builders[build](cfg)


def test_a_callback_added_in_code_gets_its_path_too(tmp_path: Path) -> None:
    cfg = compose_config(SMOKE, tmp_path)
    with open_dict(cfg):
        cfg.callbacks.memory_monitor = {
            "_target_": "lit_amp_det.callbacks.MemoryMonitor",
            "baseline_steps": 0,
        }
    with pytest.raises(ArgumentError, match=r"^callbacks\.memory_monitor\.baseline_steps=0 "):
        build_trainer(cfg)

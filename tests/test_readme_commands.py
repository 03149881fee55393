"""Every example command of the README's "Command line" section runs as written, in order, after a smoke
fit.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import REPO, run_cli

ENV = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}


def readme_commands() -> list[list[str]]:
    """The argument lists of the ``python -m lit_amp_det`` lines in the README's Command-line examples
    block.
    """
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Command line") : text.index("## Mixed precision")]
    block = re.search(r"Examples[^\n]*\n\n```bash\n(.*?)```", section, re.S)
    assert block is not None, "the Command line section has an examples block"
    commands = []
    for line in block.group(1).splitlines():
        words = shlex.split(line, comments=True)
        assert words[:3] == ["python", "-m", "lit_amp_det"], line
        commands.append(words[3:])
    return commands


@pytest.mark.slow
def test_readme_command_line_examples_run_as_written(tmp_path: Path) -> None:
    commands = readme_commands()
    assert len(commands) >= 7 and commands[0] == ["fit", "experiment=smoke"], (
        "the list starts with a smoke fit"
    )
    ran: list[str] = []
    for args in commands:
        command, overrides = args[0], args[1:]
        if any(o.startswith("data.root=/data/coco") for o in overrides):  # no COCO here: it must compose
            out = run_cli([command, "--cfg", "job", *overrides], cwd=tmp_path).stdout
            cfg = OmegaConf.create(out)
            assert cfg.data.root == "/data/coco" and cfg.model.backbone.name == "resnet50"
            ran.append("composed: " + " ".join(args))
            continue
        if (
            command == "fit" and "ckpt_path=last" in overrides
        ):  # something to resume: a user's fit stopped by Ctrl-C
            stopped = run_cli(
                ["fit", "+callbacks.sig._target_=signaller.SignalAtStep", "+callbacks.sig.step=2"],
                cwd=tmp_path,
                env=ENV,
                check=False,
            )
            assert stopped.returncode == 130, stopped.stderr[-2000:]
        placeholder = next((o for o in overrides if re.search(r"runs/fit/\d{4}-\d\d-\d\d_[\d-]+/", o)), None)
        if placeholder is not None:  # the README's example folder stands for one this test made
            newest = max((tmp_path / "runs" / "fit").iterdir(), key=lambda p: p.stat().st_mtime)
            overrides = [re.sub(r"runs/fit/[^/]+/", f"runs/fit/{newest.name}/", o) for o in overrides]
        folder = next((o.split("=", 1)[1] for o in overrides if o.startswith("data.predict_images=")), None)
        if folder is not None:  # the README's folder of pictures stands for one made here
            from test_predict_folder import pictures_folder

            pictures_folder(tmp_path / folder)
        proc = run_cli([command, *overrides], cwd=tmp_path, env=ENV)
        ran.append(" ".join([command, *overrides]))
        if "--cfg" in overrides:
            assert OmegaConf.create(proc.stdout).command == command
        elif command == "fit" and "ckpt_path=last" in overrides:
            assert "resuming " in proc.stdout and "step 100/100" in proc.stdout + proc.stderr
        elif command == "predict":
            assert "predictions: " in proc.stdout and "no mAP computed" not in proc.stdout
            predictions = max(
                (tmp_path / "runs" / "predict").glob("*/predictions.json"), key=lambda p: p.stat().st_mtime
            )  # this command's: the newest
            assert isinstance(json.loads(predictions.read_text()), list)
            assert (predictions.parent / "predictions_images.json").is_file() == (folder is not None)
    assert len(ran) == len(commands), ran

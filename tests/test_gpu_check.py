"""``make gpu-check`` on a fresh GPU machine: no pip, the steps it runs, and the short default that fits a lease.

The steps themselves need a GPU; here the CUDA queries and the step runner are stood in for, so what is checked is the
command line of every step and the report written after each."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO

from lit_amp_det.bench import gpu_check
from lit_amp_det.bench.rows import BENCHES


def test_make_gpu_check_builds_the_extension_and_never_runs_pip() -> None:
    dry = subprocess.run(["make", "-n", "gpu-check"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "pip" not in dry and "setup.py --quiet build_ext --inplace" in dry and "lit_amp_det.bench.gpu_check" in dry


@pytest.mark.parametrize("full", [False, True])
def test_the_steps_and_their_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full: bool) -> None:
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Stand-in GPU")
    commands = []

    def run(title: str, command: list[str], log: Path) -> tuple[int, str]:
        commands.append(command)
        return 0, "| op | ours ms |\n|---|---|\n| nms | 1.0 |\n" if "ops" in command else "1 passed in 1s\n"

    monkeypatch.setattr(gpu_check, "_run", run)
    gpu_check.main(["--out", str(tmp_path), "--steps", "5", *(["--full"] if full else [])])
    tests, ops, train, infer = commands
    assert tests[1:] == ["-m", "pytest", "-q", "-m", "cuda", "tests", *tests[7:]]
    assert ops[-4:-2] == ["--device", "cuda"] and "bench" in ops
    for command, bench in ((train, "train"), (infer, "infer")):
        assert command[3:7] == ["bench", bench, "--device", "cuda"]
        assert command[-1] == "--steps=5", "an option given wins over the short default"
        if full:
            assert "--rows" not in command and "--state" not in command
        else:
            rows = command[command.index("--rows") + 1].split(",")
            assert rows[0] == "torchvision-fp32" and len(rows) == 3
            assert set(rows) <= {row.name for row in BENCHES[bench].rows}, "a row the bench does not have"
            assert command[command.index("--state") + 1] == "random"
    report = (tmp_path / "gpu_check.md").read_text()
    assert "Stand-in GPU (sm_90)" in report and "| nms | 1.0 |" in report and "1 passed" in report

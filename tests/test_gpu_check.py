"""``make gpu-check`` on a fresh GPU machine: no pip, the steps it runs, and the short default that fits a
lease.

The steps themselves need a GPU; here the CUDA queries and the step runner are stood in for, so what is
checked is the command line of every step, its time limit and the report written after each. A real process
that overruns its limit is stopped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from lit_amp_det.bench import gpu_check
from lit_amp_det.bench.rows import BENCHES


def test_make_gpu_check_runs_the_check_and_never_pip() -> None:
    dry = subprocess.run(
        ["make", "-n", "gpu-check"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert "pip" not in dry and "lit_amp_det.bench.gpu_check" in dry


def test_the_step_budgets_fit_six_minutes() -> None:
    """The default run's design: every step has a budget, and they add up to at most six minutes on an
    H100.
    """
    assert list(gpu_check.STEP_BUDGET_S) == ["build", "tests", "ops", "train", "infer"]
    assert all(seconds > 0 for seconds in gpu_check.STEP_BUDGET_S.values())
    assert sum(gpu_check.STEP_BUDGET_S.values()) <= 360


def _stand_in_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Stand-in GPU")


@pytest.mark.parametrize("full", [False, True])
def test_the_steps_and_their_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full: bool) -> None:
    _stand_in_gpu(monkeypatch)
    commands, limits = [], []

    def run(
        title: str, command: list[str], log: Path, timeout: float | None, interpret: bool = False
    ) -> gpu_check.Outcome:
        commands.append(command)
        limits.append(timeout)
        output = "| op | ours ms |\n|---|---|\n| nms | 1.0 |\n" if "ops" in command else "1 passed in 1s\n"
        return gpu_check.Outcome(0, output, False)

    monkeypatch.setattr(gpu_check, "_run", run)
    gpu_check.main(["--out", str(tmp_path), "--steps", "5", *(["--full"] if full else [])])
    build, tests, ops, train, infer = commands
    assert build[1:] == ["setup.py", "--quiet", "build_ext", "--inplace"]
    assert tests[1:] == ["-m", "pytest", "-q", "-p", "no:xdist", "-m", "cuda", "tests"], "one process"
    assert limits == ([None] * 5 if full else list(gpu_check.STEP_BUDGET_S.values()))
    assert ops[-4:-2] == ["--device", "cuda"] and "bench" in ops
    for command, bench in ((train, "train"), (infer, "infer")):
        assert command[3:7] == ["bench", bench, "--device", "cuda"]
        assert command[-1] == "--steps=5", "an option given wins over the short default"
        if full:
            assert "--rows" not in command and "--state" not in command
        else:
            rows = command[command.index("--rows") + 1].split(",")
            assert rows[0] == "torchvision-fp32" and len(rows) == (5 if bench == "train" else 4)
            assert set(rows) <= {row.name for row in BENCHES[bench].rows}, "a row the bench does not have"
            assert command[command.index("--state") + 1] == "random" and "--one-process" in command
    report = (tmp_path / "gpu_check.md").read_text()
    assert "Stand-in GPU (sm_90)" in report and "| nms | 1.0 |" in report and "1 passed" in report
    assert f"| train | {gpu_check.STEP_BUDGET_S['train']} | 0 | exit code 0 |" in report
    assert f"| total | {sum(gpu_check.STEP_BUDGET_S.values())} | 0 | |" in report


def test_a_step_that_overruns_its_budget_is_recorded_and_the_next_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _stand_in_gpu(monkeypatch)
    ran = []

    def run(
        title: str, command: list[str], log: Path, timeout: float | None, interpret: bool = False
    ) -> gpu_check.Outcome:
        ran.append(log.stem)
        if log.stem == "tests":
            return gpu_check.Outcome(None, "collected 117 items\n", True)
        return gpu_check.Outcome(0, "", False)

    monkeypatch.setattr(gpu_check, "_run", run)
    with pytest.raises(SystemExit, match="these steps failed: tests"):
        gpu_check.main(["--out", str(tmp_path)])
    assert ran == ["build", "tests", "ops", "train", "infer"]
    report = (tmp_path / "gpu_check.md").read_text()
    assert f"| tests | {gpu_check.STEP_BUDGET_S['tests']} | 0 | timed out after " in report
    assert "`pytest -q -p no:xdist -m cuda tests`: timed out" in report


def test_a_step_past_its_limit_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    """A real step that runs on (here: a child that sleeps, under a parent that sleeps) is stopped at its
    limit, its output so far kept, and the stop written into its log.
    """
    child = "import time; time.sleep(60)"
    script = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
        "print('child', p.pid, flush=True); time.sleep(60)"
    )
    log = tmp_path / "sleeper.log"
    started = time.perf_counter()
    outcome = gpu_check._run("sleeper", [sys.executable, "-c", script], log, timeout=2.0)
    assert time.perf_counter() - started < 30
    assert outcome.timed_out and outcome.code is None and outcome.output.startswith("child ")
    pid = int(outcome.output.split()[1])
    deadline = time.perf_counter() + 10
    while _alive(pid) and time.perf_counter() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the step's own child outlived it"
    assert "stopped after 2 s" in log.read_text()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, stopped but not yet reaped by init, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("bench", ["train", "infer"])
def test_the_rows_gpu_check_runs_name_no_weights_to_download(bench: str) -> None:
    """A GPU machine reaches no network and starts with empty caches: the rows ``make gpu-check`` runs by
    default (R50-FPN from its seeded initialisation) must name no weights that torchvision would fetch.
    """
    from omegaconf import OmegaConf

    from lit_amp_det.bench.rows import Setting, compose, device_defaults, row_overrides

    defaults = device_defaults("cuda")
    setting = Setting(
        "cuda",
        defaults["model"],
        defaults["batch"],
        *defaults["size"],
        num_classes=81,
        steps=8,
        warmup=3,
        compile_warmup=0,
        half="fp16",
    )
    assert gpu_check.QUICK_OPTIONS[gpu_check.QUICK_OPTIONS.index("--state") + 1] == "random"
    spec = BENCHES[bench]
    names = [row.name for row in spec.rows]
    for row in gpu_check.QUICK[bench][1].split(","):
        model = OmegaConf.to_container(
            compose(row_overrides(spec, names.index(row), setting)).model, resolve=True
        )
        assert model["backbone"]["name"] == "resnet50"
        named = {
            key: value for key, value in _flat(model).items() if key.endswith("weights") and value is not None
        }
        assert not named, f"{bench} row {row}: {named} would be downloaded on first contact"


def _flat(node: object, prefix: str = "model") -> dict[str, object]:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}.{key}").items()}
    return {prefix: node}


@pytest.mark.long
def test_the_rehearsal_runs_every_step_with_no_network_pip_or_cache(tmp_path: Path) -> None:
    """``make gpu-check ARGS=--rehearse`` as a fresh GPU machine would start it: HOME and every cache empty,
    pip without an index, and any connection off the machine refused (a ``sitecustomize`` on PYTHONPATH).
    Every step runs to its end and the report times each (long: about a minute on two cores).
    """
    guard = tmp_path / "guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(
        "import socket\n_connect = socket.socket.connect\n\n\n"
        "def _local_only(self, address):\n"
        "    host = address[0] if isinstance(address, tuple) else None\n"
        "    local = ('127.0.0.1', 'localhost', '::1')\n"
        "    if self.family in (socket.AF_INET, socket.AF_INET6) and host not in local:\n"
        "        raise OSError(f'no network on a GPU machine: {address}')\n"
        "    return _connect(self, address)\n\n\n"
        "socket.socket.connect = _local_only\n"
    )
    empty = {
        name: str(tmp_path / name.lower())
        for name in ("HOME", "XDG_CACHE_HOME", "TORCH_HOME", "TRITON_CACHE_DIR")
    }
    env = {
        **os.environ,
        **empty,
        "PIP_NO_INDEX": "1",
        "PYTHONPATH": str(guard),
        "LIT_AMP_DET_RUNS": str(tmp_path / "runs"),
    }
    out = tmp_path / "report"
    proc = subprocess.run(
        ["make", "gpu-check", f"GPU_PY={sys.executable}", f"ARGS=--rehearse --out {out}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "no network on a GPU machine" not in proc.stdout + proc.stderr
    report = (out / "gpu_check.md").read_text()
    assert "REHEARSAL on the CPU" in report and "skipped" in report
    steps = report.split("## Steps")[1]
    for name, budget in gpu_check.STEP_BUDGET_S.items():
        assert (
            f"| {name} | {budget} | " in steps
            and "exit code 0 |" in steps.split(f"| {name} | ")[1].splitlines()[0]
        )
    assert f"| total | {sum(gpu_check.STEP_BUDGET_S.values())} | " in steps

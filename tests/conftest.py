"""Shared fixtures: an isolated dataset cache and run root, Hydra composition, and the CLI runner."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

from lit_amp_det.app.config import config_dir

REPO = Path(__file__).resolve().parent.parent

#: What a bad config value raises: our error, or Hydra's wrapper around it (which keeps our message).
CONFIG_ERRORS = (ValueError, FileNotFoundError, InstantiationException)

#: Overrides that make every run tiny: small images, few images, tiny model, 2 epochs.
SMOKE = ["experiment=smoke"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One dataset cache for the whole session (generated datasets are reused across tests)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(autouse=True)
def _isolated_paths(cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIT_AMP_DET_CACHE", str(cache_dir))
    monkeypatch.setenv("LIT_AMP_DET_RUNS", str(tmp_path / "runs"))


@pytest.fixture
def cpu_bf16(monkeypatch: pytest.MonkeyPatch):
    """Sets whether the CPU computes bf16 natively, for tests of what ``auto`` and the CPU fallbacks
    choose.
    """
    from lit_amp_det.precision import hardware

    def set_native(native: bool) -> None:
        monkeypatch.setattr(hardware, "_native_bf16", lambda: native)  # what every caller's answer comes from

    return set_native


def compose_config(overrides: Sequence[str] = (), output_dir: Path | None = None) -> DictConfig:
    """Composes ``conf/config.yaml`` like the CLI does, with ``paths.output_dir`` pinned (no Hydra run)."""
    extra = [f"paths.output_dir={output_dir}"] if output_dir is not None else []
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name="config", overrides=[*overrides, *extra])


#: variables read while Python, torch or Triton import, or that change how processes start: a command whose
#: environment differs from the warm parent's in one of these runs in a fresh process
_IMPORT_TIME_VARIABLES = (
    "PYTHON",
    "TRITON_",
    "TORCH",
    "PYTORCH_",
    "CUDA_",
    "OMP_",
    "MKL_",
    "KMP_",
    "LD_",
    "NCCL_",
)


class _WarmParent:
    """The session's :mod:`cli_zygote` process (one per pytest process), started on first use."""

    process: subprocess.Popen | None = None
    env: dict[str, str] = {}

    @classmethod
    def get(cls) -> subprocess.Popen | None:
        if cls.process is None:
            cls.env = cls._environment()
            cls.process = subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "cli_zygote.py")],
                env=cls.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            atexit.register(cls.process.kill)
            if (cls._answer(cls.process, 300) or {}).get("ready") is not True:
                cls.process.kill()
        return cls.process if cls.process.poll() is None else None

    @classmethod
    def _environment(cls) -> dict[str, str]:
        """The parent's environment: the one it started with, or the one it would start with now."""
        if cls.process is not None:
            return cls.env
        return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONUNBUFFERED": "1"}

    @staticmethod
    def _answer(parent: subprocess.Popen, timeout: float) -> dict | None:
        """The parent's next line, read from its pipe a byte at a time (a buffered read could take the next
        answer too, and ``select`` would then wait for it in vain); ``None`` after ``timeout`` seconds.
        """
        line, deadline = b"", time.monotonic() + timeout
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([parent.stdout], [], [], left)[0]:
                return None
            byte = os.read(parent.stdout.fileno(), 1)
            if not byte:
                raise RuntimeError("the warm parent of the CLI tests (tests/cli_zygote.py) ended")
            line += byte
        return json.loads(line)

    @classmethod
    def takes(cls, args: Sequence[str], env: dict[str, str]) -> bool:
        if os.environ.get("LIT_AMP_DET_TESTS_FRESH_PROCESSES") == "1":
            return False
        parent = cls._environment()
        keys = (parent.keys() | env.keys()) - {"PYTHONPATH", "PYTHONUNBUFFERED"}
        return not any(k.startswith(_IMPORT_TIME_VARIABLES) and parent.get(k) != env.get(k) for k in keys)

    @classmethod
    def run(
        cls, args: Sequence[str], cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess:
        parent = cls.get()
        if parent is None:
            raise RuntimeError("the warm parent of the CLI tests (tests/cli_zygote.py) did not start")
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {
                "argv": list(map(str, args)),
                "cwd": str(cwd),
                "env": env,
                "stdout": str(out),
                "stderr": str(err),
            }
            parent.stdin.write((json.dumps(request) + "\n").encode())
            parent.stdin.flush()
            pid = cls._answer(parent, 60)["pid"]
            answer = cls._answer(parent, timeout)
            if answer is None:
                os.kill(pid, signal.SIGKILL)
                cls._answer(parent, 60)
                raise subprocess.TimeoutExpired(["python", "-m", "lit_amp_det", *args], timeout)
            returncode = answer["returncode"]
            return subprocess.CompletedProcess(
                ["python", "-m", "lit_amp_det", *args],
                returncode,
                out.read_text(errors="replace"),
                err.read_text(errors="replace"),
            )


def run_cli(
    args: Sequence[str], cwd: Path, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Runs ``python -m lit_amp_det ...`` as a user would: in a process of its own, forked from a warm parent
    that has made the imports already (:mod:`cli_zygote`), or started afresh where that could differ
    (``LIT_AMP_DET_TESTS_FRESH_PROCESSES=1`` starts every one afresh).
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1", **(env or {})}
    if (
        _WarmParent.takes(args, full_env) and _WarmParent.get() is not None
    ):  # DDP: rank 0 (Lightning starts the rest)
        proc = _WarmParent.run(args, cwd, full_env, timeout=600)
    else:
        proc = subprocess.run(
            [sys.executable, "-m", "lit_amp_det", *args],
            cwd=cwd,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"CLI failed ({proc.returncode}):\nSTDOUT\n{proc.stdout[-4000:]}\nSTDERR\n{proc.stderr[-6000:]}"
        )
    return proc


def assert_same_last_weights(expected_run: Path, got_run: Path) -> None:
    """The two runs' ``checkpoints/last.ckpt`` hold the same tensors, bit for bit (an exact resume)."""

    def weights(run_dir: Path) -> dict[str, torch.Tensor]:
        return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)[
            "state_dict"
        ]

    expected, got = weights(expected_run), weights(got_run)
    assert expected.keys() == got.keys()
    for key, value in expected.items():
        assert torch.equal(value, got[key]), key


def only_run_dir(root: Path) -> Path:
    """The single run directory below ``root`` (``runs/<command>/<timestamp>``)."""
    dirs = [p.parent for p in root.glob("*/*/metrics.json")]
    assert len(dirs) == 1, f"expected one run under {root}, found {dirs}"
    return dirs[0]


class CaptureLogger(Logger):
    """Keeps every ``log_metrics`` call as ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, dict(metrics)))

    def values(self, key: str) -> list[float]:
        return [metrics[key] for _, metrics in self.calls if key in metrics]


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test``: two workers on the two cores of CI) each worker, and every command
    it starts, computes with one torch thread: two workers of two threads each would contend for the cores.
    """
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Runs the slow tests first. Tests marked ``long`` run only when the ``-m`` expression names them
    (``pytest -m long``); so do those marked ``bf16_training`` on a CPU without native bf16, where torch's
    bf16 kernels take slow paths (a 300-step bf16 parity run of the light model took 22 minutes on a 2-core
    AVX2 EPYC, against about 1 minute in fp32).
    """
    markexpr = config.getoption("markexpr") or ""
    skips = {}
    if "long" not in markexpr:
        skips["long"] = pytest.mark.skip(reason="a longer variant; run with `pytest -m long`")
    if "bf16_training" not in markexpr:
        from lit_amp_det.precision.hardware import cpu_capability, cpu_computes_bf16_natively

        if not cpu_computes_bf16_natively():
            skips["bf16_training"] = pytest.mark.skip(
                reason=f"bf16 training on a CPU without native bf16 (torch capability {cpu_capability()}) "
                "takes 20+ minutes; run with `pytest -m bf16_training`"
            )
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)
    # longest first (the end-to-end runs are marked slow): with --dist worksteal the two workers then end
    # together
    items.sort(key=lambda item: "slow" not in item.keywords)


def smooth_activations(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every ReLU replaced by SiLU, in place, for tests that compare two ways of computing the
    same convolutions at 1e-5 or closer.

    The two ways round differently (each within fp32's rounding of the exact result). Where a pre-activation
    lies within that rounding of 0, a ReLU can take different sides in them, and every gradient upstream then
    differs by that element's whole contribution (conv-BN folding in resnet18, say). A smooth activation has
    no such kink, so the comparison checks the computation alone.
    """
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ReLU):
            setattr(model, name, torch.nn.SiLU())
        else:
            smooth_activations(child)
    return model

"""The CLI tests' warm parent (``tests/cli_zygote.py``) is used wherever a forked child behaves as a fresh
process.

It once went unused on every machine that sets an import-time variable (CI sets ``PYTHONDONTWRITEBYTECODE``):
the comparison ran against the environment of a parent not yet started, so every CLI test paid the imports
again.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import _WarmParent, run_cli


def _cli_environment(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1", **extra}


def test_a_plain_command_goes_to_the_warm_parent_before_it_has_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_WarmParent, "process", None)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert _WarmParent.takes(["fit", "experiment=smoke"], _cli_environment())
    assert _WarmParent.takes(["fit"], _cli_environment(PYTHONPATH="/somewhere"))  # sys.path is set per child
    assert not _WarmParent.takes(["fit"], _cli_environment(TORCH_LOGS="+dynamo"))  # read while torch imports
    assert not _WarmParent.takes(
        ["fit"], {k: v for k, v in _cli_environment().items() if k != "PYTHONDONTWRITEBYTECODE"}
    )
    # DDP's rank 0 too: Lightning starts the other ranks from its command line, each a fresh process
    assert _WarmParent.takes(["fit", "trainer=ddp"], _cli_environment())
    monkeypatch.setenv("LIT_AMP_DET_TESTS_FRESH_PROCESSES", "1")
    assert not _WarmParent.takes(["fit"], _cli_environment())


def test_a_forked_command_prints_what_a_fresh_one_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    warm = run_cli(["fit", "--cfg", "job", "experiment=smoke"], cwd=tmp_path)
    assert _WarmParent.process is not None and _WarmParent.process.poll() is None
    monkeypatch.setenv("LIT_AMP_DET_TESTS_FRESH_PROCESSES", "1")
    fresh = run_cli(["fit", "--cfg", "job", "experiment=smoke"], cwd=tmp_path)
    assert warm.stdout == fresh.stdout and "command: fit" in warm.stdout

"""The package face is lazy: the ops import without the training stack, and ``--help`` stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("lightning", "hydra", "torchmetrics", "pycocotools")


def _modules_after(code: str) -> set[str]:
    """Top-level packages in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    probe = f"{code}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "module", ["lit_amp_det", "lit_amp_det.ops", "lit_amp_det.models", "lit_amp_det.precision.modes"]
)
def test_library_modules_import_without_the_training_stack(module):
    loaded = _modules_after(f"import {module}")
    assert not loaded & set(HEAVY), f"import {module} pulled in {sorted(loaded & set(HEAVY))}"


def test_help_imports_neither_torch_nor_lightning():
    probe = (
        "import runpy, sys\nsys.argv = ['lit_amp_det', '--help']\n"
        "try:\n    runpy.run_module('lit_amp_det', run_name='__main__')\nexcept SystemExit:\n    pass"
    )
    loaded = _modules_after(probe)
    assert "lit_amp_det" in loaded and not loaded & {"torch", "lightning", "torchmetrics"}


def test_public_names_resolve_on_first_access():
    import lit_amp_det
    from lit_amp_det.app.tasks import train
    from lit_amp_det.module import MaskRCNNModule

    assert lit_amp_det.MaskRCNNModule is MaskRCNNModule and lit_amp_det.train is train
    assert {"MaskRCNNModule", "train", "validate", "test", "predict"} <= set(dir(lit_amp_det))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        lit_amp_det.nothing  # noqa: B018

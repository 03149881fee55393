"""lit_amp_det: fast, memory-lean Mask R-CNN training and inference as PyTorch Lightning plugins.

Public entry points: :class:`MaskRCNNModule` (subclass it in research code), and the task functions
:func:`train`, :func:`validate`, :func:`test`, :func:`predict` that the CLI runs. They are imported on first
access, so ``import lit_amp_det.ops`` (the detection ops alone) does not pull in Lightning, Hydra or
torchmetrics. Importing the package builds nothing and downloads nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["MaskRCNNModule", "train", "validate", "test", "predict", "__version__"]

__version__ = "0.1.0"

#: public name -> module that defines it, imported on first access (PEP 562)
_LAZY = {
    "MaskRCNNModule": "lit_amp_det.module",
    "train": "lit_amp_det.app.tasks",
    "validate": "lit_amp_det.app.tasks",
    "test": "lit_amp_det.app.tasks",
    "predict": "lit_amp_det.app.tasks",
}

if TYPE_CHECKING:
    from lit_amp_det.app.tasks import predict, test, train, validate
    from lit_amp_det.module import MaskRCNNModule


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lit_amp_det' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

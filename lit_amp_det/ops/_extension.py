"""Loads the compiled ``lit_amp_det._C`` extension and decides, per call, whether an op can use it.

Importing registers the C++/CUDA kernels under ``torch.ops.lit_amp_det``. When the extension was not built
(or was built without kernels for the device a tensor lives on), the ops fall back to the pure-PyTorch
implementations in :mod:`lit_amp_det.ops.reference` and say so once, with the command that builds it.
"""

from __future__ import annotations

import importlib
import os
import warnings

import torch

__all__ = ["BUILD_HINT", "compiled_cuda_version", "extension_available", "extension_error", "has_kernel"]

BUILD_HINT = (
    "Build it with `make install` (or `pip install --no-build-isolation -e .` in an environment that already "
    "has torch); CUDA kernels are compiled when nvcc is found, or with LIT_AMP_DET_CUDA=1."
)

_LOAD_ERROR: str | None = None
_WARNED: set[str] = set()


def _load() -> bool:
    global _LOAD_ERROR
    if os.environ.get("LIT_AMP_DET_NO_EXT") == "1":
        _LOAD_ERROR = "disabled by LIT_AMP_DET_NO_EXT=1"
        return False
    try:
        importlib.import_module("lit_amp_det._C")
    except ImportError as error:  # not built, or built against another torch
        _LOAD_ERROR = f"{type(error).__name__}: {error}"
        return False
    return True


_LOADED = _load()
# asked once here: a call inside every op would be traced by torch.compile
_CUDA_VERSION = int(torch.ops.lit_amp_det._cuda_version()) if _LOADED else -1


def extension_available() -> bool:
    """Whether the compiled extension was imported (its kernels are registered)."""
    return _LOADED


def extension_error() -> str | None:
    """Why the compiled extension could not be imported, or None when it was."""
    return _LOAD_ERROR


def compiled_cuda_version() -> int:
    """CUDA version the extension's kernels were compiled for (e.g. 13000), or -1 (CPU-only build or none)."""
    return _CUDA_VERSION


def has_kernel(op_name: str, device: torch.device) -> bool:
    """Whether ``lit_amp_det::<op_name>`` has a compiled kernel for ``device``; warns once per op and device if not.

    Meta and fake tensors (``torch.compile`` tracing, ``register_fake``) count as covered whenever the
    extension is loaded, since every op registers a fake kernel.
    """
    if not _LOADED:
        _warn_once("missing", op_name, f"the compiled extension lit_amp_det._C is missing ({_LOAD_ERROR})")
        return False
    if device.type in ("cpu", "meta") or (device.type == "cuda" and _CUDA_VERSION > 0):
        return True
    _warn_once(device.type, op_name, f"lit_amp_det._C was built without {device.type} kernels")
    return False


def _warn_once(key: str, op_name: str, reason: str) -> None:
    """One warning per cause (extension missing, or no kernels for a device type), not one per op or call."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(
        f"lit_amp_det.ops.{op_name}: {reason}, so lit_amp_det's ops run on their pure-PyTorch fallback "
        f"(correct, slower). {BUILD_HINT}",
        RuntimeWarning,
        stacklevel=4,  # the caller of the op
    )

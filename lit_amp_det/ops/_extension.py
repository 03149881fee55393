"""Loads the compiled ``lit_amp_det._C`` extension and decides, per call, whether an op can use it.

Importing registers the C++ CPU kernels under ``torch.ops.lit_amp_det`` and, for CUDA tensors, the Triton
kernels of :mod:`lit_amp_det.ops.triton` (registered without importing triton; it is imported on the first
CUDA call). When the extension was not built, or a device has no kernels (CUDA without triton installed), the
ops fall back to the pure-PyTorch implementations in :mod:`lit_amp_det.ops.reference` and say so once, with
the command that builds it.
"""

from __future__ import annotations

import importlib
import os
import warnings

import torch

__all__ = [
    "BUILD_HINT",
    "compiled_cuda_version",
    "extension_available",
    "extension_error",
    "has_kernel",
    "triton_cuda_kernels",
]

BUILD_HINT = (
    "Build it with `make install` (or `pip install --no-build-isolation -e .` in an environment that already "
    "has torch); no CUDA toolkit is needed: the CUDA kernels are Triton kernels (the `triton` package that "
    "comes with torch)."
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


def _register_triton() -> bool:
    if not _LOADED:
        return False
    from lit_amp_det.ops.triton._register import register_cuda_kernels

    return register_cuda_kernels()


_TRITON_CUDA = _register_triton()


def extension_available() -> bool:
    """Whether the compiled extension was imported (its kernels are registered).

    Returns:
        bool: ``True`` when ``lit_amp_det._C`` was imported; ``False`` when it is missing, was built against
        another torch, or ``LIT_AMP_DET_NO_EXT=1`` disabled it (:func:`extension_error` says which).
    """
    return _LOADED


def extension_error() -> str | None:
    """Why the compiled extension could not be imported, or None when it was.

    Returns:
        str or None: the import error (``"<type>: <message>"``) or ``"disabled by LIT_AMP_DET_NO_EXT=1"``;
        ``None`` when the extension is loaded.
    """
    return _LOAD_ERROR


def compiled_cuda_version() -> int:
    """CUDA version compiled into ``lit_amp_det._C``: -1, as the extension holds C++ CPU kernels only (the
    CUDA kernels are Triton kernels, compiled at run time; :func:`triton_cuda_kernels` says whether they are
    registered).

    Returns:
        int: the CUDA version compiled in (``13000`` for 13.0), -1 for a CPU-only build, as this package's
        builds are, and -1 when the extension is not loaded.
    """
    return _CUDA_VERSION


def triton_cuda_kernels() -> bool:
    """Whether the Triton kernels are registered as the CUDA kernels of ``torch.ops.lit_amp_det``."""
    return _TRITON_CUDA


def has_kernel(op_name: str, device: torch.device) -> bool:
    """Whether ``lit_amp_det::<op_name>`` has a compiled kernel for ``device``; warns once per op and device
    if not.

    Meta and fake tensors (``torch.compile`` tracing, ``register_fake``) count as covered whenever the
    extension is loaded, since every op registers a fake kernel.
    """
    if not _LOADED:
        _warn_once("missing", op_name, f"the compiled extension lit_amp_det._C is missing ({_LOAD_ERROR})")
        return False
    if device.type in ("cpu", "meta") or (device.type == "cuda" and _TRITON_CUDA):
        return True
    reason = (
        "triton is not installed, so there are no CUDA kernels"
        if device.type == "cuda"
        else (f"lit_amp_det has no {device.type} kernels")
    )
    _warn_once(device.type, op_name, reason)
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
        stacklevel=4,
    )  # stacklevel: the op's caller

"""Which ``trainer.precision`` the device runs fast: ``auto``, and the CPU fallbacks of the half precisions.

Mixed precision pays on a CPU only where the CPU computes bf16 itself. torch routes a bf16 matmul or
convolution to oneDNN's fast kernels only on CPUs with AVX-512 (BW/VL/DQ), AMX-BF16 or AVX-NE-CONVERT;
everywhere else (AVX2-only CPUs: Intel Core chips without AVX-512, AMD before Zen 4, many cloud VMs) it takes
slow paths, and a bf16 training step runs many times slower than an fp32 one. So:

- ``trainer.precision=auto`` (the default) is ``16-mixed`` on CUDA, ``bf16-mixed`` on a CPU that computes bf16
  natively, and ``32-true`` on any other CPU; the choice and its reason are logged.
- ``16-mixed`` / ``16-weights`` on a CPU (unless ``precision.fp16_on_cpu=true``) run as their bf16 twin where
  bf16 is native and as ``32-true`` where it is not, with a warning that says which and why.
- ``bf16-mixed`` / ``bf16-weights`` asked for by name run as asked, with a warning on a CPU without native
  bf16.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

__all__ = ["AUTO", "auto_precision", "cpu_computes_bf16_natively", "cpu_capability", "resolve_precision"]

#: the ``trainer.precision`` value that picks the device's fast precision
AUTO = "auto"
#: what a CPU without native bf16 costs, for the messages
_MEASURED_COST = (
    "the light Mask R-CNN's training step ran 12x slower in bf16-mixed than in 32-true on such a CPU"
)


def cpu_capability() -> str:
    """torch's name for the vector instructions its CPU kernels use here (``AVX2``, ``AVX512``, ...)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):  # a torch built without it
        return "unknown"


def cpu_computes_bf16_natively() -> bool:
    """Whether torch runs bf16 matmuls and convolutions through oneDNN's fast kernels on this CPU.

    The test torch makes before it hands a bf16 matmul to oneDNN (``mkldnn_bf16_device_check``); where that
    private op is missing, torch's CPU capability stands in: only its AVX-512 levels have the fast path. Asked
    once per process.

    Returns:
        bool: ``True`` where bf16 matmuls and convolutions take oneDNN's fast kernels; ``False`` where they do
        not, or torch has no oneDNN (mkldnn).
    """
    return _native_bf16()


@functools.cache
def _native_bf16() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    op = _torch_bf16_op()
    if op is not None:
        with contextlib.suppress(RuntimeError):
            return bool(op())
    return cpu_capability().startswith(("AVX512", "AMX"))


def _torch_bf16_op() -> Callable[[], bool] | None:
    return getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)


def _no_native_bf16() -> str:
    return (
        f"this CPU has no native bf16 (torch CPU capability {cpu_capability()}; bf16 matmuls and "
        "convolutions take slow paths)"
    )


def auto_precision(device: str) -> str:
    """What ``trainer.precision=auto`` runs on ``device`` (see the module; no log line:
    :func:`resolve_precision`).
    """
    return "16-mixed" if device == "cuda" else "bf16-mixed" if cpu_computes_bf16_natively() else "32-true"


def resolve_precision(precision: str, device: str, fp16_on_cpu: bool = False) -> str:
    """The precision that runs for ``trainer.precision=precision`` on ``device`` (``"cpu"`` or ``"cuda"``), by
    the rules of the module docstring, logged or warned as it says. Any other value is returned as it is (the
    caller checks it).

    Args:
        precision (str): the ``trainer.precision`` asked for (``auto``, ``32-true``, ``16-mixed``, ...).
        device (str): ``"cpu"`` or ``"cuda"``.
        fp16_on_cpu (bool): run ``16-mixed`` / ``16-weights`` on a CPU as asked rather than as their bf16 twin
            or ``32-true`` (``precision.fp16_on_cpu``). Default: ``False``.

    Returns:
        str: the ``trainer.precision`` value that runs.
    """
    native_bf16 = device != "cpu" or cpu_computes_bf16_natively()
    if precision == AUTO:
        chosen = auto_precision(device)
        reason = (
            "fp16 autocast on the GPU"
            if device == "cuda"
            else "this CPU computes bf16 natively"
            if native_bf16
            else f"{_no_native_bf16()}: {_MEASURED_COST}"
        )
        rank_zero_info(f"trainer.precision=auto: {chosen} ({reason})")
        return chosen
    if device != "cpu" or fp16_on_cpu or not precision.startswith(("16-", "bf16-")):
        return precision
    if precision.startswith("16-"):
        twin = f"bf{precision}" if native_bf16 else "32-true"
        why = "fp16 on CPUs is slow and needs loss scaling" + (
            "" if native_bf16 else f", and {_no_native_bf16()}"
        )
        rank_zero_warn(
            f"trainer.precision={precision} on a CPU runs as {twin} ({why}); set "
            "precision.fp16_on_cpu=true to force fp16."
        )
        return twin
    if not native_bf16:
        rank_zero_warn(
            f"trainer.precision={precision}: {_no_native_bf16()}, and {_MEASURED_COST}. Use "
            "trainer.precision=auto (32-true here) unless you are testing bf16 itself."
        )
    return precision

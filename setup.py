"""Builds the ``lit_amp_det._C`` extension: the op schemas and their C++ CPU kernels.

Package metadata lives in ``pyproject.toml``; this file only declares the extension, because its flags
depend on the installed torch. Build it against the torch you run with::

    pip install --no-build-isolation -e .      # or: make install
    python setup.py build_ext --inplace        # rebuild after editing lit_amp_det/csrc

No CUDA toolkit is involved: the CUDA kernels of the same ops are Triton kernels
(``lit_amp_det/ops/triton``), compiled at run time by the ``triton`` package that comes with torch, and
registered for the CUDA dispatch key when ``lit_amp_det.ops`` is imported.

Environment switch: ``LIT_AMP_DET_BUILD_EXT=0`` installs the pure-Python package only (the ops then use their
fallback).
"""

from __future__ import annotations

import os
from pathlib import Path

from setuptools import setup

CSRC = Path("lit_amp_det") / "csrc"


def _files(*patterns: str) -> list[str]:
    return sorted(str(p) for pattern in patterns for p in CSRC.glob(pattern))


def torch_cxx_runtime() -> list[str]:
    """The shared C++ runtime (``libstdc++.so.6``) that torch itself loaded, as a link argument.

    Some toolchains link the C++ runtime statically (a ``g++`` whose library folder has only ``libstdc++.a``,
    as a ``CXX`` set to a vendor compiler may be). The extension then carries its own ``__cxa_throw`` and
    personality routine, and the first ``TORCH_CHECK`` that throws across into torch's frames crashes the
    process instead of raising. Naming torch's own shared runtime on the link line makes the extension share
    it on every toolchain; where it is already the default, this changes nothing.
    """
    import torch  # noqa: F401  (loads the runtime this process maps)

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libstdc++.so" in line}
    except OSError:  # not Linux: nothing to pin
        return []
    return sorted(paths)[:1]


def extensions() -> tuple[list, dict]:
    if os.environ.get("LIT_AMP_DET_BUILD_EXT", "1") == "0":
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    extension = CppExtension(
        name="lit_amp_det._C",
        sources=_files("*.cpp", "ops/*.cpp", "ops/cpu/*.cpp"),
        depends=_files("**/*.h"),
        # at::parallel_for is OpenMP-backed; -g0: no debug information (Python's flags add -g), a faster build
        extra_compile_args={"cxx": ["-O3", "-fopenmp", "-g0"]},
        extra_link_args=["-fopenmp", *torch_cxx_runtime()],
    )
    return [extension], {"build_ext": BuildExtension}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

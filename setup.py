"""Builds the ``lit_amp_det._C`` extension (C++ CPU kernels, plus CUDA kernels when a toolkit is found).

Package metadata lives in ``pyproject.toml``; this file only declares the extension, because its flags
depend on the installed torch. Build it against the torch you run with::

    pip install --no-build-isolation -e .      # or: make install
    python setup.py build_ext --inplace        # rebuild after editing lit_amp_det/csrc

Environment switches:

* ``LIT_AMP_DET_CUDA=1`` forces the CUDA kernels (error if torch or nvcc lack CUDA), ``=0`` skips them;
  unset, they are built when torch is a CUDA build and a CUDA toolkit (``CUDA_HOME`` / nvcc) is found.
* ``TORCH_CUDA_ARCH_LIST`` picks GPU architectures; without it and without a visible GPU, ``9.0`` (H100/H200).
* ``LIT_AMP_DET_BUILD_EXT=0`` installs the pure-Python package only (the ops then use their fallback).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
CSRC = Path("lit_amp_det") / "csrc"


def _files(*patterns: str) -> list[str]:
    return sorted(str(p) for pattern in patterns for p in CSRC.glob(pattern))


def _want_cuda(torch, cuda_home: str | None) -> bool:
    forced = os.environ.get("LIT_AMP_DET_CUDA", "").strip()
    if forced not in ("", "0", "1"):
        raise SystemExit(f"LIT_AMP_DET_CUDA={forced!r}: use 1 (build CUDA kernels), 0 (skip them) or leave it unset")
    available = torch.version.cuda is not None and cuda_home is not None
    if forced == "1" and not available:
        raise SystemExit(
            f"LIT_AMP_DET_CUDA=1 but torch {torch.__version__} has CUDA {torch.version.cuda} and CUDA_HOME is "
            f"{cuda_home}; install a CUDA build of torch and a CUDA toolkit (nvcc), or set LIT_AMP_DET_CUDA=0"
        )
    return available if forced == "" else forced == "1"


def _wheel_cuda_include() -> list[str]:
    """The CUDA headers shipped in torch's nvidia-* wheels, which match torch's CUDA version exactly."""
    include = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "include"
    return [f"-I{include}"] if include.is_dir() else []


def _cuda_version_number(torch) -> str:
    """torch.version.cuda as CUDA_VERSION spells it: "13.0" -> "13000"."""
    major, minor = (int(part) for part in torch.version.cuda.split(".")[:2])
    return str(1000 * major + 10 * minor)


def _point_cuda_home_at_a_full_toolkit() -> None:
    """Sets CUDA_HOME to a toolkit with libraries when it is unset and nvcc on PATH is only a wrapper.

    torch guesses CUDA_HOME as the parent of the nvcc on PATH; with a wrapper in /usr/local/bin that is
    /usr/local, which has no lib64/libcudart.so to link against.
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    nvcc = shutil.which("nvcc")
    candidates = ([Path(nvcc).resolve().parent.parent] if nvcc else []) + [Path("/usr/local/cuda")]
    for home in candidates:
        if (home / "bin" / "nvcc").exists() and (home / "lib64").is_dir():
            os.environ["CUDA_HOME"] = str(home)
            return


def extensions() -> tuple[list, dict]:
    if os.environ.get("LIT_AMP_DET_BUILD_EXT", "1") == "0":
        return [], {}
    _point_cuda_home_at_a_full_toolkit()
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    sources = _files("*.cpp", "ops/*.cpp", "ops/cpu/*.cpp")
    cxx_flags = ["-O3", "-fopenmp"]  # at::parallel_for is OpenMP-backed: without -fopenmp it runs serially
    kwargs = dict(
        name="lit_amp_det._C",
        depends=_files("**/*.h", "**/*.cuh"),
        extra_link_args=["-fopenmp"],
    )
    if _want_cuda(torch, CUDA_HOME):
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        nvcc_flags = ["-O3", "--expt-relaxed-constexpr", *_wheel_cuda_include()]
        extension = CUDAExtension(
            sources=sources + _files("ops/cuda/*.cu"),
            define_macros=[("WITH_CUDA", None), ("LIT_AMP_DET_CUDA_VERSION", _cuda_version_number(torch))],
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            **kwargs,
        )
    else:
        extension = CppExtension(sources=sources, extra_compile_args={"cxx": cxx_flags}, **kwargs)
    return [extension], {"build_ext": BuildExtension}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

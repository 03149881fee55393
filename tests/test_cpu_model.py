"""Which hosts split their 512-bit vectors (:func:`lit_amp_det.cpu_model.splits_512_bit_vectors`), from
``/proc/cpuinfo`` texts; the names the benches print are tested in ``tests/test_bench_repeats.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from lit_amp_det import cpu_model


def _cpuinfo(vendor: str, family: int, model: int, flags: str) -> str:
    return (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
            f"model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 {flags}\n\n")


@pytest.mark.parametrize(("vendor", "family", "model", "flags", "expected"), [
    ("AuthenticAMD", 25, 17, "avx512f avx512_bf16", True),  # Genoa: the dev VM's Zen 4 host
    ("AuthenticAMD", 25, 97, "avx512f avx512_bf16", True),  # Raphael (Ryzen 7000)
    ("AuthenticAMD", 25, 17, "", False),  # a Zen 4 VM whose AVX-512 is masked: no 512-bit instructions at all
    ("AuthenticAMD", 26, 2, "avx512f avx512_bf16", False),  # Turin (Zen 5): full width
    ("AuthenticAMD", 25, 1, "", False),  # Milan (Zen 3): AVX2 only
    ("GenuineIntel", 6, 143, "avx512f avx512_bf16 amx_bf16", False),
])
def test_splits_512_bit_vectors_only_on_zen4_with_avx512(vendor: str, family: int, model: int, flags: str,
                                                         expected: bool) -> None:
    assert cpu_model.splits_512_bit_vectors(_cpuinfo(vendor, family, model, flags)) is expected


def test_splits_512_bit_vectors_without_cpuinfo_is_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_model, "CPUINFO_PATH", str(tmp_path / "absent"))
    assert cpu_model.read_cpuinfo() == ""
    assert cpu_model.splits_512_bit_vectors("") is False


def test_this_machine_is_read_once_and_agrees_with_its_text() -> None:
    assert cpu_model.splits_512_bit_vectors() is cpu_model.splits_512_bit_vectors(cpu_model.read_cpuinfo())

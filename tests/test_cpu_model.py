"""Which CPU this is, from ``/proc/cpuinfo`` texts: the names the benches print (:func:`lit_amp_det.cpu_model.cpu_name`)
and which hosts split their 512-bit vectors (:func:`lit_amp_det.cpu_model.splits_512_bit_vectors`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import cpuinfo_text

from lit_amp_det import cpu_model


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
    assert cpu_model.splits_512_bit_vectors(cpuinfo_text(vendor, family, model, flags=flags)) is expected


def test_splits_512_bit_vectors_without_cpuinfo_is_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_model, "CPUINFO_PATH", str(tmp_path / "absent"))
    assert cpu_model.read_cpuinfo() == ""
    assert cpu_model.splits_512_bit_vectors("") is False


def test_this_machine_is_read_once_and_agrees_with_its_text() -> None:
    assert cpu_model.splits_512_bit_vectors() is cpu_model.splits_512_bit_vectors(cpu_model.read_cpuinfo())


@pytest.mark.parametrize(("vendor", "family", "model", "name", "expected"), [
    ("AuthenticAMD", 25, 17, "AMD EPYC", "AMD EPYC (family 25 model 17, Zen 4)"),  # Genoa: the dev VM's slow host
    ("AuthenticAMD", 25, 1, "AMD EPYC", "AMD EPYC (family 25 model 1, Zen 3)"),  # Milan: the AVX2 VM
    ("AuthenticAMD", 25, 97, "AMD Ryzen 9 7950X", "AMD Ryzen 9 7950X (family 25 model 97, Zen 4)"),
    ("AuthenticAMD", 26, 2, "AMD EPYC", "AMD EPYC (family 26 model 2, Zen 5)"),  # Turin
    ("AuthenticAMD", 23, 49, "AMD EPYC 7B12", "AMD EPYC 7B12 (family 23 model 49, Zen 2)"),
    ("AuthenticAMD", 23, 1, "AMD EPYC 7601", "AMD EPYC 7601 (family 23 model 1, Zen/Zen+)"),  # Naples
    ("GenuineIntel", 6, 143, "Intel(R) Xeon(R) Platinum 8481C",
     "Intel(R) Xeon(R) Platinum 8481C (family 6 model 143)"),
])
def test_cpu_name_tells_hosts_with_one_model_name_apart(vendor: str, family: int, model: int, name: str,
                                                       expected: str) -> None:
    # the first processor's block counts (the second one's model is a decoy)
    assert cpu_model.cpu_name(cpuinfo_text(vendor, family, model, name)) == expected


def test_cpu_name_without_family_numbers_is_the_model_name() -> None:
    assert cpu_model.cpu_name("processor\t: 0\nmodel name\t: Some CPU\n") == "Some CPU"
    assert cpu_model.cpu_name("") != ""  # platform's name stands in


def test_cpu_name_without_proc_cpuinfo_is_platforms_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # macOS, Windows or a sandbox without /proc: the bench still names the machine
    monkeypatch.setattr(cpu_model, "CPUINFO_PATH", str(tmp_path / "absent"))
    monkeypatch.setattr(cpu_model.platform, "processor", lambda: "arm")
    assert cpu_model.cpu_name() == "arm"

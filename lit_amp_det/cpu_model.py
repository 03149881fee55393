"""Which CPU this is: its model name, family and model numbers (``/proc/cpuinfo``) and, for AMD, its Zen generation.

Two hosts can report one model name ("AMD EPYC") and the same AVX-512 BF16 flags yet differ 2x in FLOP rate: Zen 4
runs a 512-bit instruction as two 256-bit halves, Zen 5 at full width. The benches name the generation and key their
cached peaks by it (:func:`cpu_name`); the Winograd convolutions take smaller layers where the CPU splits its
512-bit vectors (:func:`splits_512_bit_vectors`), because there a convolution's multiplications cost twice as much
against the memory-bound tile transforms.
"""

from __future__ import annotations

import functools
import platform

__all__ = ["CPUINFO_PATH", "amd_microarchitecture", "cpu_name", "cpuinfo_fields", "read_cpuinfo",
           "splits_512_bit_vectors"]

#: Where Linux lists the CPU's vendor, family, model, name and flags.
CPUINFO_PATH = "/proc/cpuinfo"
#: AMD family 19h (25) models of Zen 4; its other models are Zen 3 (AMD's family 19h documents list both).
_ZEN4_MODEL_RANGES = ((0x10, 0x1F), (0x60, 0x7F), (0xA0, 0xAF))


def read_cpuinfo() -> str:
    """The text of ``/proc/cpuinfo``, or ``""`` where there is none (macOS, Windows, some sandboxes)."""
    try:
        with open(CPUINFO_PATH) as f:
            return f.read()
    except OSError:
        return ""


def cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's ``key: value`` lines of a ``/proc/cpuinfo`` text."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the end of the first processor's block
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def amd_microarchitecture(family: int, model: int) -> str | None:
    """The Zen generation of an AMD CPU from its ``cpu family`` and ``model`` (``/proc/cpuinfo``), or None.

    Cloud VMs report the same model name ("AMD EPYC") and the same AVX-512 BF16 flags on Zen 4 and Zen 5 hosts, yet
    Zen 4 runs a 512-bit instruction as two 256-bit halves and Zen 5 at full width: per core and cycle, Zen 4 does
    32 fp32 / 64 bf16 FLOPs, Zen 5 twice that. On the 2-core dev VM the bench's probe reads fp32 226 / bf16 445
    GFLOP/s on a Zen 4 host (family 25 model 17) and 472 / 963 on the faster one, so a peak, and every ratio that
    leans on the FLOP rate, belongs to the generation, which the model name alone does not tell.
    """
    if family == 23:
        return "Zen 2" if model >= 0x30 else "Zen/Zen+"
    if family == 25:
        return "Zen 4" if any(low <= model <= high for low, high in _ZEN4_MODEL_RANGES) else "Zen 3"
    if family == 26:
        return "Zen 5"
    return None


def _amd_generation(fields: dict[str, str]) -> str | None:
    family, model = fields.get("cpu family", ""), fields.get("model", "")
    if fields.get("vendor_id") != "AuthenticAMD" or not (family.isdigit() and model.isdigit()):
        return None
    return amd_microarchitecture(int(family), int(model))


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name with its family and model numbers, and for AMD its Zen generation
    (:func:`amd_microarchitecture`): ``AMD EPYC (family 25 model 17, Zen 4)``. From ``/proc/cpuinfo`` (or the
    ``cpuinfo`` text given), else what :mod:`platform` knows. It names the machine in the bench reports and keys the
    cached peaks (:func:`lit_amp_det.bench.roofline.machine_key`): two hosts with one model name can differ 2x in
    peak FLOP rate."""
    fields = cpuinfo_fields(read_cpuinfo() if cpuinfo is None else cpuinfo)
    name = fields.get("model name") or platform.processor() or platform.machine()
    family, model = fields.get("cpu family", ""), fields.get("model", "")
    if not (family.isdigit() and model.isdigit()):
        return name
    generation = _amd_generation(fields)
    return f"{name} (family {family} model {model}{f', {generation}' if generation else ''})"


def splits_512_bit_vectors(cpuinfo: str | None = None) -> bool:
    """Whether this CPU (or the one a ``/proc/cpuinfo`` text describes) has AVX-512 but runs each 512-bit
    instruction as two 256-bit halves: AMD Zen 4. There a bf16 or fp32 convolution does half a full-width core's
    FLOPs per cycle (the bench's bf16 peak probe: 445-457 GFLOP/s on the dev VM's two Zen 4 cores, 963 on two Zen 5
    cores of the same VM type), while memory-bound work runs at the same speed. Read once per process."""
    return _splits_512_bit_vectors() if cpuinfo is None else _splits(cpuinfo)


@functools.cache
def _splits_512_bit_vectors() -> bool:
    return _splits(read_cpuinfo())


def _splits(cpuinfo: str) -> bool:
    fields = cpuinfo_fields(cpuinfo)
    return "avx512f" in fields.get("flags", "").split() and _amd_generation(fields) == "Zen 4"

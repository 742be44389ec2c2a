"""This machine as /proc/cpuinfo describes it: the CPU's flags, its model name and its SIMD
flags (standard library only, so a child in a peer's own environment reads them too)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

SIMD = re.compile(r"^(avx|amx|fma|f16c|sse4|vnni|bf16)")


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def cpu_flags() -> set[str]:
    """/proc/cpuinfo's first `flags` line (empty where there is none)."""
    return next((set(ln.split(":", 1)[1].split()) for ln in _cpuinfo()
                 if ln.startswith("flags")), set())


def cpu_model() -> str | None:
    """The CPU's model name, None where /proc/cpuinfo does not say."""
    return next((ln.split(":", 1)[1].strip() for ln in _cpuinfo()
                 if ln.startswith("model name")), None)


# AMD's (cpu family, first model, last model) -> microarchitecture; in family 23 below
# model 0x30, Zen 1 (Naples 0x01, Raven Ridge 0x11, Dali 0x20) and Zen+ (Pinnacle Ridge and
# Colfax 0x08, Picasso 0x18) alternate by eights
AMD_CORES = ((23, 0x00, 0x07, "Zen 1"), (23, 0x08, 0x0F, "Zen+"), (23, 0x10, 0x17, "Zen 1"),
             (23, 0x18, 0x1F, "Zen+"), (23, 0x20, 0x2F, "Zen 1"), (23, 0x30, 0xFF, "Zen 2"),
             (25, 0x00, 0x0F, "Zen 3"), (25, 0x10, 0x1F, "Zen 4"), (25, 0x20, 0x5F, "Zen 3"),
             (25, 0x60, 0xAF, "Zen 4"), (26, 0x00, 0xFF, "Zen 5"))

# Intel's family 6 server cores: (model, first stepping, last stepping) -> microarchitecture
# (model 0x55 is three cores told apart by the stepping)
INTEL_CORES = ((0x3F, 0, 0xF, "Haswell-EP"), (0x4F, 0, 0xF, "Broadwell-EP"),
               (0x55, 0, 4, "Skylake-SP"), (0x55, 5, 7, "Cascade Lake"),
               (0x55, 10, 11, "Cooper Lake"), (0x6A, 0, 0xF, "Ice Lake-SP"),
               (0x6C, 0, 0xF, "Ice Lake-SP"), (0x8F, 0, 0xF, "Sapphire Rapids"),
               (0xCF, 0, 0xF, "Emerald Rapids"), (0xAD, 0, 0xF, "Granite Rapids"),
               (0xAE, 0, 0xF, "Granite Rapids"), (0xAF, 0, 0xF, "Sierra Forest"))


def microarchitecture(vendor: str | None, family: int | None, model: int | None,
                      stepping: int | None = None) -> str | None:
    """The core's name from /proc/cpuinfo's vendor, family, model and (for Intel's model
    0x55) stepping: AMD's Zen cores, Intel's server cores; None where unknown."""
    if family is None or model is None:
        return None
    if vendor == "AuthenticAMD":
        return next((name for fam, low, high, name in AMD_CORES
                     if fam == family and low <= model <= high), None)
    if vendor != "GenuineIntel" or family != 6:
        return None
    named = [(low, high, name) for number, low, high, name in INTEL_CORES if number == model]
    if stepping is None:  # one core a model, else the stepping decides
        return named[0][2] if len(named) == 1 else None
    return next((name for low, high, name in named if low <= stepping <= high), None)


def cpu_facts() -> dict[str, Any]:
    """The CPU's model name, its vendor, family and model numbers (what names the
    microarchitecture where the model name does not, as "AMD EPYC") and its SIMD flags,
    from /proc/cpuinfo."""
    model, flags, ids = None, [], {}
    for line in _cpuinfo():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        if key in ("vendor_id", "cpu family", "model", "stepping") and key not in ids:
            ids[key] = value.strip()
        if key == "flags" and not flags:
            flags = [f for f in value.split() if SIMD.match(f)]
    family = " ".join(f"{name} {ids[key]}" for name, key in (
        ("family", "cpu family"), ("model", "model"), ("stepping", "stepping")) if key in ids)
    core = microarchitecture(ids.get("vendor_id"), *(
        int(ids[k]) if ids.get(k, "").isdigit() else None
        for k in ("cpu family", "model", "stepping")))
    return {"cpu": model or "unknown", "flags": " ".join(flags) or "unknown",
            "family": " ".join(filter(None, (ids.get("vendor_id"), family))) or "unknown",
            "microarchitecture": core or "unknown"}

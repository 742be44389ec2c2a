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


# AMD's (cpu family, first model, last model) -> microarchitecture, for CPUs named only
# "AMD EPYC" (the machines these benchmarks have met); others keep their model name
AMD_CORES = ((23, 0x00, 0x2F, "Zen/Zen+"), (23, 0x30, 0xFF, "Zen 2"),
             (25, 0x00, 0x0F, "Zen 3"), (25, 0x10, 0x1F, "Zen 4"), (25, 0x20, 0x5F, "Zen 3"),
             (25, 0x60, 0xAF, "Zen 4"), (26, 0x00, 0xFF, "Zen 5"))


def microarchitecture(vendor: str | None, family: int | None, model: int | None) -> str | None:
    """The core's name from /proc/cpuinfo's vendor, family and model (AMD only; None
    where unknown)."""
    if vendor != "AuthenticAMD" or family is None or model is None:
        return None
    return next((name for fam, low, high, name in AMD_CORES
                 if fam == family and low <= model <= high), None)


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
        int(ids[k]) if ids.get(k, "").isdigit() else None for k in ("cpu family", "model")))
    return {"cpu": model or "unknown", "flags": " ".join(flags) or "unknown",
            "family": " ".join(filter(None, (ids.get("vendor_id"), family))) or "unknown",
            "microarchitecture": core or "unknown"}

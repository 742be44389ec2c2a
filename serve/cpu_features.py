"""What this CPU can do, from /proc/cpuinfo's flags (empty where they cannot be read): the
facts an int8 or bfloat16 path is chosen by, read the same way at export and at serving.
Imports nothing: it ships inside archives."""

from __future__ import annotations

from functools import cache
from pathlib import Path

# the instructions that multiply u8 by s8 into int32 without an int16 step
INT32_DOT_PRODUCTS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


@cache
def flags() -> frozenset[str]:
    """The CPU's flags (avx2, avx512_vnni, ...); empty where /proc/cpuinfo cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def int32_dot_products(cpu_flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU multiplies u8 by s8 into int32 in one instruction (AVX512-VNNI,
    AVX-VNNI or AMX); False where the flags cannot be read."""
    return bool(INT32_DOT_PRODUCTS & (flags() if cpu_flags is None else cpu_flags))


def int8_products_saturate(cpu_flags: frozenset[str] | None = None) -> bool:
    """Whether int8 matrix products here go through AVX2's vpmaddubsw, which adds two
    u8 x s8 products into a *saturating* int16 before widening (an x86 CPU without
    AVX512-VNNI, AVX-VNNI or AMX): a pair of large activations and weights clips there.
    Quantizers then keep activations to 7 bits ("reduce_range", as torchao's x86 quantizer
    and ONNX Runtime advise for such CPUs), so no pair can reach the int16 limit
    (127 x 128 x 2 < 32767). False where the flags cannot be read or the CPU is not x86."""
    found = flags() if cpu_flags is None else cpu_flags
    return "avx2" in found and not int32_dot_products(found)

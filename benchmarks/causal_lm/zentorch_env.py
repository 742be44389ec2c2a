"""The AMD zentorch peer of benchmarks/causal_lm/peers.py (`--zentorch`): its own virtual
environment, made once (benchmarks/harness/venv.py), and the rows that its child
(zentorch_child.py) measures.

zentorch's wheels are built against one torch minor version (zentorch 2.13.0.2 for torch
2.13.0+cpu, the torch compress runs on; 2.14.0.1, from the same source tag, for torch 2.14)
and published for Linux x86_64 only. The environment is `~/.cache/compress/zentorch-env`:
`python -m venv`, `pip install torch==2.13.0` (the CPU wheel), then zentorch, transformers,
gguf and accelerate at the versions below; a marker written after the last step (with the
child's facts and the install list) tells a finished install from a half-made or older one,
which is made again. The figures need Inductor's freezing (zentorch_child.py says why).
What cannot be made raises `ZentorchError`, one line: peers.py's exit 2.
`zentorch.llm.optimize` (r5.0-5.1, on top of IPEX) is gone from these releases (it raises
"deprecated ... run generative models with vLLM"), so the rows are
`torch.compile(backend="zentorch")` of the Hugging Face model in fp32 and bf16.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.machine import cpu_flags
from benchmarks.harness.rounds import run_module
from benchmarks.harness.venv import PeerError, Venv, ensure_venv, python_of

DEFAULT_VENV = "~/.cache/compress/zentorch-env"  # no variable yet: docs/environment.md
ZENTORCH = "2.13.0.2"  # built for torch 2.13.0+cpu (its _build_info.__torchversion__)
VENV = Venv("zentorch", DEFAULT_VENV, ".compress-zentorch-ready",
            (("torch==2.13.0",),  # first, so that the CPU wheel is the one installed
             (f"zentorch=={ZENTORCH}", "transformers==5.24.0", "gguf==0.19.0",
              "accelerate==1.15.0")),  # transformers loads a GGUF with accelerate
            prefix="peers_llm", pinned=True)
READY = VENV.marker  # written once every install step has succeeded
INSTALL = VENV.steps
DTYPES = ("fp32", "bf16")
PYTHONS = ((3, 9), (3, 13))  # the interpreters zentorch publishes wheels for
CHILD = "benchmarks.causal_lm.zentorch_child"  # run as python -m CHILD by the zentorch venv


class ZentorchError(ValueError):
    """zentorch does not install or run here (one line); a ValueError: exit 2."""


def venv_path() -> Path:
    """~/.cache/compress/zentorch-env."""
    return Path(DEFAULT_VENV).expanduser()


def parse_dtypes(text: str | None) -> list[str]:
    """The comma-separated dtypes of `--zentorch` (none: not asked); ZentorchError on an
    unknown one."""
    dtypes = [d for d in (text or "").split(",") if d]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ZentorchError(f"unknown zentorch dtype {unknown[0]!r} (known: {', '.join(DTYPES)})")
    return list(dict.fromkeys(dtypes))


def unsupported(system: str | None = None, machine: str | None = None,
                version: tuple[int, int] | None = None, flags: set[str] | None = None
                ) -> str | None:
    """Why zentorch has no wheel for this platform, Python or CPU (None: it has one)."""
    system, machine = system or platform.system(), machine or platform.machine()
    version = version or sys.version_info[:2]
    if system != "Linux" or machine not in ("x86_64", "AMD64"):
        return f"zentorch {ZENTORCH} has wheels for Linux x86_64 only, not {system} {machine}"
    if not PYTHONS[0] <= version <= PYTHONS[1]:
        return (f"zentorch {ZENTORCH} has wheels for Python 3.{PYTHONS[0][1]}-3.{PYTHONS[1][1]}"
                f", not {version[0]}.{version[1]}")
    flags = cpu_flags() if flags is None else flags
    if flags and "avx2" not in flags:
        return "zentorch's ZenDNN kernels need AVX2, which this CPU does not have"
    return None


def ensure_zentorch(venv: Path, echo: Callable[[str], None]) -> dict[str, Any]:
    """Make the environment unless its marker says it is finished; the marker's facts
    (versions, zentorch's build config, whether bf16 runs natively); made again when the
    install list changed. ZentorchError when it cannot be made."""
    reason = unsupported()
    if reason:
        raise ZentorchError(reason)

    def facts(folder: Path) -> dict[str, Any]:
        found = run_module(python_of(folder), CHILD, {"mode": "facts"})
        if "error" in found:
            raise ZentorchError(f"import zentorch in {folder}: {found['error']}")
        return {k: v for k, v in found.items() if k != "pid"}

    try:
        return ensure_venv(VENV, echo, venv, facts)
    except PeerError as exc:
        raise ZentorchError(str(exc)) from None


def zentorch_items(gguf: Path, dtypes: list[str], echo: Callable[[str], None]
                   ) -> list[dict[str, Any]]:
    """One row a dtype, run by the environment's Python (made first); bf16 is left out,
    with a note, where zentorch's CPU lacks native bf16 (AVX512-BF16 or AMX)."""
    facts = ensure_zentorch(venv_path(), echo)
    items = []
    for dtype in dtypes:
        if dtype == "bf16" and not facts.get("bf16"):
            echo("peers_llm: zentorch bf16 left out: this CPU has no native bf16")
            continue
        items.append({"name": f"zentorch {dtype}", "runtime": "zentorch", "weights": dtype,
                      "python": str(python_of(venv_path())), "child": CHILD,
                      "facts": facts, "rounds": [],
                      "spec": {"mode": "measure", "model": str(gguf), "dtype": dtype}})
    return items

"""The AMD zentorch peer of benchmarks/peers_llm.py (`--zentorch`): its own virtual
environment, made once, and the rows that its child (peers_llm_zentorch.py) measures.

zentorch's wheels are built against one torch minor version (zentorch 2.13.0.2 for torch
2.13.0+cpu, the torch compress runs on; 2.14.0.1, from the same source tag, for torch 2.14)
and published for Linux x86_64 only. The environment is `~/.cache/compress/zentorch-env`:
`python -m venv`, `pip install torch==2.13.0` (the CPU wheel), then zentorch, transformers,
gguf and accelerate at the versions below; a marker written after the last step (with the
child's facts and the install list) tells a finished install from a half-made or older one,
which is made again. The figures need Inductor's freezing (peers_llm_zentorch.py says
why). What cannot be made raises `ZentorchError`, one line: peers_llm.py's exit 2.
`zentorch.llm.optimize` (r5.0-5.1, on top of IPEX) is gone from these releases (it raises
"deprecated ... run generative models with vLLM"), so the rows are
`torch.compile(backend="zentorch")` of the Hugging Face model in fp32 and bf16.
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peers_optimum import PeerError, _call

from compress.report.rebench import run_json_child

DEFAULT_VENV = "~/.cache/compress/zentorch-env"  # no variable yet: docs/environment.md
READY = ".compress-zentorch-ready"  # written once every install step has succeeded
ZENTORCH = "2.13.0.2"  # built for torch 2.13.0+cpu (its _build_info.__torchversion__)
INSTALL = (["torch==2.13.0"],  # first, so that the CPU wheel is the one installed
           [f"zentorch=={ZENTORCH}", "transformers==5.24.0", "gguf==0.19.0",
            "accelerate==1.15.0"])  # transformers loads a GGUF with accelerate
DTYPES = ("fp32", "bf16")
PYTHONS = ((3, 9), (3, 13))  # the interpreters zentorch publishes wheels for
CHILD = Path(__file__).resolve().with_name("peers_llm_zentorch.py")


class ZentorchError(ValueError):
    """zentorch does not install or run here (one line); a ValueError: exit 2."""


def venv_path() -> Path:
    """~/.cache/compress/zentorch-env."""
    return Path(DEFAULT_VENV).expanduser()


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


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


def cpu_flags() -> set[str]:
    """/proc/cpuinfo's first `flags` line (empty where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return set()
    return next((set(ln.split(":", 1)[1].split()) for ln in lines if ln.startswith("flags")),
                set())


def ensure_venv(venv: Path, echo: Callable[[str], None]) -> dict[str, Any]:
    """Make the environment unless its marker says it is finished; the marker's facts
    (versions, zentorch's build config, whether bf16 runs natively); made again when the
    install list changed. ZentorchError when it cannot be made."""
    reason = unsupported()
    if reason:
        raise ZentorchError(reason)
    marker = venv / READY
    if marker.is_file():
        try:
            facts = dict(json.loads(marker.read_text()))
        except (ValueError, TypeError):  # a marker without the facts: made again
            facts = {}
        if facts.get("install") == [p for ps in INSTALL for p in ps]:
            return facts
        marker.unlink()
    if venv.exists():
        if not (venv / "pyvenv.cfg").is_file():
            raise ZentorchError(f"{venv} exists and is not a virtual environment; remove it")
        echo(f"peers_llm: {venv} is a half-made or older install; making it again")
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{venv.name}.log"
    log.write_text("")
    echo(f"peers_llm: making the zentorch environment {venv} (once; pip's output in {log})")
    try:
        _call([sys.executable, "-m", "venv", str(venv)], "python -m venv", log)
        for packages in INSTALL:
            _call([str(venv / "bin" / "pip"), "install", *packages],
                  f"pip install {' '.join(packages)}", log)
        facts = run_json_child([str(python_of(venv)), str(CHILD), json.dumps({"mode": "facts"})])
    except PeerError as exc:
        raise ZentorchError(str(exc)) from None
    if "error" in facts:
        raise ZentorchError(f"import zentorch in {venv}: {facts['error']}")
    facts = {**{k: v for k, v in facts.items() if k != "pid"},
             "install": [p for ps in INSTALL for p in ps]}
    marker.write_text(json.dumps(facts))
    return facts


def zentorch_items(gguf: Path, dtypes: list[str], echo: Callable[[str], None]
                   ) -> list[dict[str, Any]]:
    """One row a dtype, run by the environment's Python (made first); bf16 is left out,
    with a note, where zentorch's CPU lacks native bf16 (AVX512-BF16 or AMX)."""
    facts = ensure_venv(venv_path(), echo)
    items = []
    for dtype in dtypes:
        if dtype == "bf16" and not facts.get("bf16"):
            echo("peers_llm: zentorch bf16 left out: this CPU has no native bf16")
            continue
        items.append({"name": f"zentorch {dtype}", "runtime": "zentorch", "weights": dtype,
                      "python": str(python_of(venv_path())), "child": str(CHILD),
                      "facts": facts, "rounds": [],
                      "spec": {"mode": "measure", "model": str(gguf), "dtype": dtype}})
    return items

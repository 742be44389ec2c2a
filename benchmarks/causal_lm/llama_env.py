"""The llama.cpp peer of benchmarks/causal_lm/peers.py: its own virtual environment with
llama-cpp-python, built once, and Q8_0 and Q4_0 GGUFs of the shipped Q4_1 file's weights
made by llama.cpp's own quantize.

The environment is `$COMPRESS_LLAMA_VENV`, default `~/.cache/compress/llama-venv`: `python
-m venv`, then `pip install llama-cpp-python` (an sdist, compiled with cmake and the C
compiler, `CMAKE_ARGS=-DGGML_NATIVE=ON` so that ggml uses this CPU's AVX-512 / VNNI); a
marker written after the last step tells a finished install from a half-made one, which is
made again (benchmarks/harness/venv.py). The GGUFs are written into a temporary folder and
renamed into `$COMPRESS_LLAMA_GGUF`, default `~/.cache/compress/llama-gguf/`, and made again
when the source file's sha256 changes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.rounds import run_module
from benchmarks.harness.venv import PeerError, Venv, ensure_venv, python_of
from compress.runfolder.files import sha256_file

GGUF_VAR, DEFAULT_GGUF = "COMPRESS_LLAMA_GGUF", "~/.cache/compress/llama-gguf"
CMAKE_ARGS = "-DGGML_NATIVE=ON"  # ggml built for this CPU's instruction sets
LLAMA = Venv("llama.cpp", "~/.cache/compress/llama-venv", ".compress-llama-ready",
             (("llama-cpp-python",),), variable="COMPRESS_LLAMA_VENV", prefix="peers_llm",
             note="llama-cpp-python compiles from source, minutes",
             settings=(f"CMAKE_ARGS={CMAKE_ARGS}",))
TARGETS = ("Q8_0", "Q4_0")  # made from the shipped file beside it
SOURCE_FILE = "source.json"  # the source's path and sha256 the GGUFs were made from
CHILD = "benchmarks.causal_lm.llama_child"  # run as python -m CHILD by the llama venv


def venv_path() -> Path:
    """`$COMPRESS_LLAMA_VENV`, else ~/.cache/compress/llama-venv."""
    return LLAMA.path()


def gguf_dir() -> Path:
    """`$COMPRESS_LLAMA_GGUF`, else ~/.cache/compress/llama-gguf."""
    return Path(os.environ.get(GGUF_VAR) or DEFAULT_GGUF).expanduser()


def ensure_llama(venv: Path, echo: Callable[[str], None]) -> dict[str, Any]:
    """Make the environment in `venv` unless its marker says it is finished; the marker's
    facts (versions and llama.cpp's system info, the cmake arguments)."""
    def facts(folder: Path) -> dict[str, Any]:
        found = llama_child(folder, {"mode": "facts"}, "llama.cpp facts")
        return {**{k: v for k, v in found.items() if k != "pid"}, "cmake_args": CMAKE_ARGS}

    return ensure_venv(LLAMA, echo, venv, facts)


def llama_child(venv: Path, spec: dict[str, Any], what: str) -> dict[str, Any]:
    """The JSON line of llama_child.py run by the environment's Python; PeerError with its
    one line when it failed."""
    answer = run_module(python_of(venv), CHILD, spec)
    if "error" in answer:
        raise PeerError(f"{what}: {answer['error']}")
    return answer


def target_path(folder: Path, source: Path, quant: str) -> Path:
    """`<folder>/<source name with its quantization replaced by quant>.gguf`."""
    stem = source.name.removesuffix(".gguf")
    base = stem.rsplit(".", 1)[0] if "." in stem else stem
    return folder / f"{base}.{quant}.gguf"


def build_ggufs(source: Path, venv: Path | None, folder: Path, echo: Callable[[str], None],
                targets: tuple[str, ...] = TARGETS,
                quantize: Callable[[Path, Path, str], None] | None = None) -> dict[str, Path]:
    """{quantization: path} of the GGUFs of `source`'s weights that llama.cpp's quantize
    makes (requantized from the source's types), kept while the source's sha256 is
    unchanged. `quantize(source, target, quant)` makes one file: by default the `venv`'s
    llama-cpp-python (llama_child.py), or e.g. a built `llama-quantize` binary."""
    sha = sha256_file(source)
    paths = {quant: target_path(folder, source, quant) for quant in targets}
    try:
        made = json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        made = {}
    if made.get("sha256") == sha and all(p.is_file() for p in paths.values()):
        echo(f"peers_llm: {', '.join(targets)} GGUFs up to date in {folder} (cached)")
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=folder))
    try:
        for quant, path in paths.items():
            echo(f"peers_llm: llama.cpp quantize {source.name} -> {path.name}")
            if quantize is not None:
                quantize(source, tmp / path.name, quant)
                continue
            if venv is None:
                raise PeerError(f"quantize to {quant}: no llama.cpp environment given")
            llama_child(venv, {"mode": "quantize", "source": str(source),
                               "target": str(tmp / path.name), "quant": quant,
                               "threads": os.cpu_count() or 1}, f"quantize to {quant}")
        for path in paths.values():
            os.replace(tmp / path.name, path)
        (folder / SOURCE_FILE).write_text(json.dumps({"source": str(source), "sha256": sha}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths


def gguf_bytes_per_token(path: Path) -> dict[str, Any]:
    """Weight bytes one decode step reads from a GGUF: every tensor once, except the token
    embedding, of which one row is read, unless the file has no `output.weight` and it is
    the output projection too (then all of it); with the tensor types' byte counts."""
    from gguf import GGUFReader

    tensors = GGUFReader(str(path)).tensors
    return bytes_per_token([(t.name, t.tensor_type.name, int(t.n_bytes),
                             int(t.shape[-1]) if len(t.shape) > 1 else 1) for t in tensors])


def bytes_per_token(tensors: list[tuple[str, str, int, int]]) -> dict[str, Any]:
    """The sum for `gguf_bytes_per_token` over (name, type, bytes, rows) tuples."""
    tied = not any(name == "output.weight" for name, *_ in tensors)
    total, types = 0, {}
    for name, kind, size, rows in tensors:
        read = size if name != "token_embd.weight" or tied else size // rows
        total += read
        types[kind] = types.get(kind, 0) + size
    return {"bytes_per_token": total, "file_tensor_bytes": types, "tied_output": tied}

"""The llama.cpp peer of benchmarks/peers_llm.py: its own virtual environment with
llama-cpp-python, built once, and Q8_0 and Q4_0 GGUFs of the shipped Q4_1 file's weights
made by llama.cpp's own quantize.

The environment is `$COMPRESS_LLAMA_VENV`, default `~/.cache/compress/llama-venv`: `python
-m venv`, then `pip install llama-cpp-python` (an sdist, compiled with cmake and the C
compiler, `CMAKE_ARGS=-DGGML_NATIVE=ON` so that ggml uses this CPU's AVX-512 / VNNI); a
marker written after the last step tells a finished install from a half-made one, which is
made again (the pattern and the helpers of peers_optimum.py). The GGUFs are written into a
temporary folder and renamed into `$COMPRESS_LLAMA_GGUF`, default
`~/.cache/compress/llama-gguf/`, and made again when the source file's sha256 changes.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peers_optimum import PeerError, _call

from compress.report.rebench import run_json_child
from compress.runfolder.files import sha256_file

VENV_VAR, DEFAULT_VENV = "COMPRESS_LLAMA_VENV", "~/.cache/compress/llama-venv"
GGUF_VAR, DEFAULT_GGUF = "COMPRESS_LLAMA_GGUF", "~/.cache/compress/llama-gguf"
READY = ".compress-llama-ready"  # written once every install step has succeeded
PACKAGE = "llama-cpp-python"
CMAKE_ARGS = "-DGGML_NATIVE=ON"  # ggml built for this CPU's instruction sets
TARGETS = ("Q8_0", "Q4_0")  # made from the shipped file beside it
SOURCE_FILE = "source.json"  # the source's path and sha256 the GGUFs were made from
CHILD = Path(__file__).resolve().with_name("peers_llm_llama.py")


def venv_path() -> Path:
    """`$COMPRESS_LLAMA_VENV`, else ~/.cache/compress/llama-venv."""
    return Path(os.environ.get(VENV_VAR) or DEFAULT_VENV).expanduser()


def gguf_dir() -> Path:
    """`$COMPRESS_LLAMA_GGUF`, else ~/.cache/compress/llama-gguf."""
    return Path(os.environ.get(GGUF_VAR) or DEFAULT_GGUF).expanduser()


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path, echo: Callable[[str], None]) -> dict[str, Any]:
    """Make the environment unless its marker says it is finished; the marker's facts
    (versions and llama.cpp's system info)."""
    marker = venv / READY
    if marker.is_file():
        try:
            return dict(json.loads(marker.read_text()))
        except (ValueError, TypeError):  # a marker without the facts: ask the environment
            pass
    elif venv.exists():
        if not (venv / "pyvenv.cfg").is_file():
            raise PeerError(f"{venv} exists and is not a virtual environment; remove it or "
                            f"set {VENV_VAR} to another folder")
        echo(f"peers_llm: {venv} is a half-made install; making it again")
        shutil.rmtree(venv)
    if not marker.is_file():
        venv.parent.mkdir(parents=True, exist_ok=True)
        log = venv.parent / f"{venv.name}.log"
        log.write_text("")
        echo(f"peers_llm: making the llama.cpp environment {venv} (once: {PACKAGE} compiles "
             f"from source, minutes; pip's output in {log})")
        _call([sys.executable, "-m", "venv", str(venv)], "python -m venv", log)
        _call(["env", f"CMAKE_ARGS={CMAKE_ARGS}", str(venv / "bin" / "pip"), "install",
               PACKAGE], f"pip install {PACKAGE}", log)
    facts = llama_child(venv, {"mode": "facts"}, "llama.cpp facts")
    facts = {k: v for k, v in facts.items() if k != "pid"}
    marker.write_text(json.dumps({**facts, "cmake_args": CMAKE_ARGS}))
    return {**facts, "cmake_args": CMAKE_ARGS}


def llama_child(venv: Path, spec: dict[str, Any], what: str) -> dict[str, Any]:
    """The JSON line of peers_llm_llama.py run by the environment's Python; PeerError
    with its one line when it failed."""
    answer = run_json_child([str(python_of(venv)), str(CHILD), json.dumps(spec)])
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
    llama-cpp-python (peers_llm_llama.py), or e.g. a built `llama-quantize` binary."""
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

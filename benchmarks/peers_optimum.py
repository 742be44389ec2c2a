"""The Optimum peer of benchmarks/peers.py: its own virtual environment, made once, and
Optimum's fp32 and int8 ONNX files of a run's fine-tuned model as compress export folders.

Optimum-onnx 0.1 pins transformers below 5 (compress uses 5.x), so it lives in its own
environment: `$COMPRESS_PEER_VENV`, default `~/.cache/compress/optimum-venv`, made with
`python -m venv`, `pip install torch==2.13.0`, `pip install "optimum-onnx[onnxruntime]"`; a
marker file written after the last step tells a finished install from a half-made one
(which is made again). The files are built with that environment's `optimum-cli` into a
temporary folder and renamed into `<run>/peers/optimum_fp32|optimum_int8/`, each with an
`export.json` so compress loads and scores them with the code it uses for its own ONNX.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

VENV_VAR = "COMPRESS_PEER_VENV"
DEFAULT_VENV = "~/.cache/compress/optimum-venv"
READY = ".compress-peer-ready"  # written once every install step has succeeded
INSTALL = (["torch==2.13.0"], ["optimum-onnx[onnxruntime]"])  # torch first: the CPU wheel
PEERS_DIR = "peers"
NAMES = ("optimum_fp32", "optimum_int8")
OPTIMUM_EXPORT = "export onnx --task text-classification"  # optimum-cli's subcommand
QUANTIZE_ISA = "--avx512_vnni"  # ORT dynamic int8, u8 activations x s8 weights
INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


class PeerError(Exception):
    """The Optimum environment or its files could not be made (one line)."""


def venv_path() -> Path:
    """`$COMPRESS_PEER_VENV`, else ~/.cache/compress/optimum-venv."""
    return Path(os.environ.get(VENV_VAR) or DEFAULT_VENV).expanduser()


def ensure_venv(venv: Path, echo: Callable[[str], None]) -> dict[str, Any]:
    """Make the environment unless its marker says it is finished; the marker's facts."""
    marker = venv / READY
    if marker.is_file():
        try:
            return dict(json.loads(marker.read_text()))
        except (ValueError, TypeError):  # a marker without the facts: ask the environment
            facts = _facts(venv)
            marker.write_text(json.dumps(facts))
            return facts
    if venv.exists():
        if not (venv / "pyvenv.cfg").is_file():
            raise PeerError(f"{venv} exists and is not a virtual environment; remove it or "
                            f"set {VENV_VAR} to another folder")
        echo(f"peers: {venv} is a half-made install; making it again")
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{venv.name}.log"
    log.write_text("")
    echo(f"peers: making the Optimum environment {venv} (once; a few hundred MB)")
    _call([sys.executable, "-m", "venv", str(venv)], "python -m venv", log)
    for packages in INSTALL:
        _call([str(venv / "bin" / "pip"), "install", *packages],
              f"pip install {' '.join(packages)}", log)
    facts = _facts(venv)
    marker.write_text(json.dumps(facts))
    return facts


def _facts(venv: Path) -> dict[str, str]:
    """The versions of the peer's packages in `venv`."""
    return {name: _version(venv, name) for name in ("optimum-onnx", "onnxruntime",
                                                    "transformers", "torch")}


def _version(venv: Path, package: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({package!r}))"
    return _call([str(venv / "bin" / "python"), "-c", code], f"{package} version").strip()


def _call(command: list[str], what: str, log: Path | None = None) -> str:
    """Run `command`; its stdout. Output goes to `log`; a failure raises one line."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise PeerError(f"{what}: cannot start {command[0]}: {exc}") from None
    if log is not None:
        with open(log, "a") as out:
            out.write(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
        errors = [ln for ln in lines if re.search(r"error", ln, re.IGNORECASE)]
        cause = (errors or lines or ["no output"])[-1][:300]
        where = f" (full output in {log})" if log else ""
        raise PeerError(f"{what} failed with exit code {done.returncode}: {cause}{where}")
    return done.stdout


def is_current(folder: Path, source_sha: str) -> bool:
    """Whether `folder` holds a built peer of the model whose weights have `source_sha`."""
    try:
        meta = json.loads((folder / "export.json").read_text())
    except (OSError, ValueError):
        return False
    return (folder / "model.onnx").is_file() and meta.get("source_sha256") == source_sha


def build_peers(run_dir: Path, source: Path, source_sha: str, label_names: list[str],
                venv: Path, facts: dict[str, Any], echo: Callable[[str], None],
                under: str = PEERS_DIR) -> list[Path]:
    """Optimum's fp32 export and its dynamic int8 of `source` under `<run>/<under>/`
    (default `peers/`; kept while `source_sha`, the weights' sha256, is unchanged); the two
    folders."""
    peers = run_dir / under
    folders = [peers / name for name in NAMES]
    if all(is_current(folder, source_sha) for folder in folders):
        echo("peers: Optimum files up to date (cached)")
        return folders
    peers.mkdir(parents=True, exist_ok=True)
    log = peers / "optimum.log"
    log.write_text("")
    cli = str(venv / "bin" / "optimum-cli")
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=peers))
    try:
        fp32, raw, int8 = tmp / NAMES[0], tmp / "quantized", tmp / NAMES[1]
        echo(f"peers: optimum-cli export onnx {source.relative_to(run_dir)}")
        _call([cli, *OPTIMUM_EXPORT.split(), "--model", str(source), str(fp32)],
              "optimum-cli export onnx", log)
        echo(f"peers: optimum-cli onnxruntime quantize {QUANTIZE_ISA}")
        _call([cli, "onnxruntime", "quantize", "--onnx_model", str(fp32), QUANTIZE_ISA,
               "-o", str(raw)], "optimum-cli onnxruntime quantize", log)
        quantized = sorted(raw.glob("*.onnx"))
        if len(quantized) != 1:
            raise PeerError(f"optimum-cli onnxruntime quantize wrote {len(quantized)} .onnx "
                            f"files, expected 1 (see {log})")
        int8.mkdir()
        os.replace(quantized[0], int8 / "model.onnx")
        for extra in fp32.iterdir():  # config and tokenizer files
            if extra.suffix != ".onnx" and extra.is_file():
                shutil.copy2(extra, int8 / extra.name)
        common = {"producer": f"optimum-onnx {facts.get('optimum-onnx', '?')}",
                  "source": str(source.relative_to(run_dir)), "source_sha256": source_sha}
        for folder, quantize in ((fp32, None), (int8, f"dynamic {QUANTIZE_ISA}")):
            _check_graph(folder / "model.onnx")
            meta = {"format": "onnx", "file": "model.onnx", "text": True, "inputs": INPUTS,
                    "outputs": ["logits"], "label_names": label_names, "input_shape": [],
                    "quantize": quantize, **common}
            (folder / "export.json").write_text(json.dumps(meta, indent=2))
        for name, folder in zip(NAMES, folders, strict=True):
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(tmp / name, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folders


def _check_graph(path: Path) -> None:
    """The file's inputs are among compress's text inputs and it has a `logits` output."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    inputs = [i.name for i in graph.input]
    outputs = [o.name for o in graph.output]
    if not set(inputs) <= set(INPUTS) or "logits" not in outputs:
        raise PeerError(f"{path.name}: inputs {inputs}, outputs {outputs}; compress feeds "
                        f"{INPUTS} and reads logits")

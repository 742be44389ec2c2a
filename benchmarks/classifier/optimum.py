"""The Optimum peer of benchmarks/classifier/peers.py: its own virtual environment, made
once, and Optimum's fp32 and int8 ONNX files of a run's fine-tuned model as compress export
folders.

Optimum-onnx 0.1 pins transformers below 5 (compress uses 5.x), so it lives in its own
environment (benchmarks/harness/venv.py): `$COMPRESS_PEER_VENV`, default
`~/.cache/compress/optimum-venv`, made with `python -m venv`, `pip install torch==2.13.0`,
`pip install "optimum-onnx[onnxruntime]"`; a marker file written after the last step tells a
finished install from a half-made one (which is made again). The files are built with that
environment's `optimum-cli` into a temporary folder and renamed into
`<run>/peers/optimum_fp32|optimum_int8/`, each with an `export.json` so compress loads and
scores them with the code it uses for its own ONNX.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.venv import PeerError, Venv, call

OPTIMUM = Venv("Optimum", "~/.cache/compress/optimum-venv", ".compress-peer-ready",
               (("torch==2.13.0",), ("optimum-onnx[onnxruntime]",)),  # torch first: the CPU wheel
               variable="COMPRESS_PEER_VENV", note="a few hundred MB",
               facts=("optimum-onnx", "onnxruntime", "transformers", "torch"))
PEERS_DIR = "peers"
NAMES = ("optimum_fp32", "optimum_int8")
OPTIMUM_EXPORT = "export onnx --task text-classification"  # optimum-cli's subcommand
QUANTIZE_ISA = "--avx512_vnni"  # ORT dynamic int8, u8 activations x s8 weights
INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


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
        call([cli, *OPTIMUM_EXPORT.split(), "--model", str(source), str(fp32)],
             "optimum-cli export onnx", log)
        echo(f"peers: optimum-cli onnxruntime quantize {QUANTIZE_ISA}")
        call([cli, "onnxruntime", "quantize", "--onnx_model", str(fp32), QUANTIZE_ISA,
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

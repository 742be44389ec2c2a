"""The Optimum peer of benchmarks/classifier/peers.py: its own virtual environment, made
once, and Optimum's fp32 and int8 ONNX files of a run's fine-tuned model as compress export
folders.

Optimum-onnx 0.1 pins transformers below 5 (compress uses 5.x), so it lives in its own
environment (benchmarks/harness/venv.py): `$COMPRESS_PEER_VENV`, default
`~/.cache/compress/optimum-venv`, made with `python -m venv`, `pip install torch==2.13.0`,
`pip install "optimum-onnx[onnxruntime]"`; a marker file written after the last step tells a
finished install from a half-made one (which is made again). The files are built with that
environment's `optimum-cli` into a temporary folder and renamed into
`<run>/peers/optimum_fp32|optimum_int8_O1|O2|O3/`, each with an `export.json` so compress
loads and scores them with the code it uses for its own ONNX. The int8 file is built once per
`optimum-cli export onnx --optimize` level (O1-O3), each quantized the same way, so the table
can take Optimum at its best.
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
FP32 = "optimum_fp32"  # the plain export (no --optimize): the fp32 row and OpenVINO's source
INT8 = "optimum_int8"  # a dynamic int8 file's name: f"{INT8}_{level}"
# optimum-cli export onnx --optimize: O1 basic graph optimizations, O2 and the transformer
# fusions (attention, skip layer norm, bias GELU), O3 and the GELU approximation (O4 is
# fp16 on CUDA only); each level is built, quantized and timed, and the table takes the
# fastest as Optimum at its best
LEVELS = ("O1", "O2", "O3")
OPTIMUM_EXPORT = "export onnx --task text-classification"  # optimum-cli's subcommand
QUANTIZE_ISA = "--avx512_vnni"  # ORT dynamic int8, u8 activations x s8 weights
INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


def int8_name(level: str) -> str:
    """The folder (and row) name of the dynamic int8 file exported at `level`."""
    return f"{INT8}_{level}"


def is_current(folder: Path, source_sha: str) -> bool:
    """Whether `folder` holds a built peer of the model whose weights have `source_sha`."""
    try:
        meta = json.loads((folder / "export.json").read_text())
    except (OSError, ValueError):
        return False
    return (folder / "model.onnx").is_file() and meta.get("source_sha256") == source_sha


def build_peers(run_dir: Path, source: Path, source_sha: str, label_names: list[str],
                venv: Path, facts: dict[str, Any], echo: Callable[[str], None],
                under: str = PEERS_DIR, levels: tuple[str, ...] | list[str] = LEVELS,
                failed: dict[str, str] | None = None) -> dict[str, Path]:
    """Optimum's plain fp32 export of `source` (`optimum_fp32`) and, per `--optimize`
    level, its dynamic int8 (`optimum_int8_O2`...: exported at that level, then quantized),
    under `<run>/<under>/` (default `peers/`; each kept while `source_sha`, the weights'
    sha256, is unchanged, so a new level builds alone); {name: folder}. An int8 level
    whose export or quantization fails is left out, and `failed` (when given) gets
    `{"<under>/<name>": why}`, so that the table says which level could not be built and
    why; the fp32 export failing is an error (every level is made from the same model)."""
    peers = run_dir / under
    folders = {name: peers / name for name in [FP32, *(int8_name(lv) for lv in levels)]}
    missing = [name for name, folder in folders.items() if not is_current(folder, source_sha)]
    if not missing:
        echo(f"peers: Optimum files of {source.relative_to(run_dir)} up to date (cached)")
        return folders
    peers.mkdir(parents=True, exist_ok=True)
    log = peers / "optimum.log"
    log.write_text("")
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=peers))
    try:
        for name in list(missing):
            level = None if name == FP32 else name.removeprefix(f"{INT8}_")
            try:
                _build_one(run_dir, source, source_sha, label_names, venv, facts, echo,
                           tmp, name, level, log)
            except PeerError as exc:
                if level is None or failed is None:
                    raise
                echo(f"peers: Optimum --optimize {level} of {source.relative_to(run_dir)} "
                     f"left out: {exc}")
                failed[f"{under}/{name}"] = str(exc)
                missing.remove(name)
                del folders[name]
        for name in missing:
            if folders[name].exists():
                shutil.rmtree(folders[name])
            os.replace(tmp / name, folders[name])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folders


def _build_one(run_dir: Path, source: Path, source_sha: str, label_names: list[str],
               venv: Path, facts: dict[str, Any], echo: Callable[[str], None], tmp: Path,
               name: str, level: str | None, log: Path) -> None:
    """One peer folder `tmp/name`: the plain fp32 export (`level` None), or the export at
    `--optimize level` quantized to dynamic int8."""
    cli = str(venv / "bin" / "optimum-cli")
    exported = tmp / (name if level is None else f"export_{level}")
    optimize = [] if level is None else ["--optimize", level]
    echo(f"peers: optimum-cli export onnx {' '.join(optimize)} {source.relative_to(run_dir)}")
    call([cli, *OPTIMUM_EXPORT.split(), *optimize, "--model", str(source), str(exported)],
         f"optimum-cli export onnx {' '.join(optimize)}".strip(), log)
    _single_onnx(exported, "optimum-cli export onnx", log)
    folder, quantize = exported, None
    if level is not None:
        raw, folder, quantize = tmp / f"quantized_{level}", tmp / name, f"dynamic {QUANTIZE_ISA}"
        echo(f"peers: optimum-cli onnxruntime quantize {QUANTIZE_ISA} (--optimize {level})")
        call([cli, "onnxruntime", "quantize", "--onnx_model", str(exported), QUANTIZE_ISA,
              "-o", str(raw)], "optimum-cli onnxruntime quantize", log)
        folder.mkdir()
        os.replace(_single_onnx(raw, "optimum-cli onnxruntime quantize", log),
                   folder / "model.onnx")
        for extra in exported.iterdir():  # config and tokenizer files
            if extra.suffix != ".onnx" and extra.is_file():
                shutil.copy2(extra, folder / extra.name)
    _check_graph(folder / "model.onnx")
    meta = {"format": "onnx", "file": "model.onnx", "text": True, "inputs": INPUTS,
            "outputs": ["logits"], "label_names": label_names, "input_shape": [],
            "quantize": quantize, "optimize": level,
            "producer": f"optimum-onnx {facts.get('optimum-onnx', '?')}",
            "source": str(source.relative_to(run_dir)), "source_sha256": source_sha}
    (folder / "export.json").write_text(json.dumps(meta, indent=2))


def _single_onnx(folder: Path, step: str, log: Path) -> Path:
    """The one .onnx file a step wrote into `folder` (renamed `model.onnx`, where compress
    looks for it)."""
    found = sorted(folder.glob("*.onnx"))
    if len(found) != 1:
        raise PeerError(f"{step} wrote {len(found)} .onnx files, expected 1 (see {log})")
    if found[0].name != "model.onnx":
        os.replace(found[0], folder / "model.onnx")
    return folder / "model.onnx"


def _check_graph(path: Path) -> None:
    """The file's inputs are among compress's text inputs and it has a `logits` output."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    inputs = [i.name for i in graph.input]
    outputs = [o.name for o in graph.output]
    if not set(inputs) <= set(INPUTS) or "logits" not in outputs:
        raise PeerError(f"{path.name}: inputs {inputs}, outputs {outputs}; compress feeds "
                        f"{INPUTS} and reads logits")

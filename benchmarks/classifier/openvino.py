"""The OpenVINO peer of benchmarks/classifier/peers.py: NNCF's static int8 of the Optimum
fp32 ONNX file of a run's fine-tuned model, timed by OpenVINO on the CPU.

OpenVINO and NNCF come from the package index into the peer environment (the Optimum one,
optimum.py), as a second install step with its own marker, so a finished Optimum
environment is kept. The file is built once per source model in `<run>/peers/openvino_int8/`
(rebuilt when the fine-tuned weights change) and measured, like every other peer, in a
fresh process per round: `python -m benchmarks.classifier.openvino_child`, run by the peer
environment's Python. OpenVINO does not officially support AMD CPUs; where it fails, its
row says how.
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
from benchmarks.harness.runs import full_recipe
from benchmarks.harness.venv import PeerError, call, python_of, version
from compress.data.datasets import load_data
from compress.recipe.datasets import resolve_data

READY = ".compress-peer-openvino-ready"
INSTALL = ["openvino", "nncf"]
NAME = "openvino_int8"
LABEL = "OpenVINO int8 static (NNCF)"
CHILD = "benchmarks.classifier.openvino_child"  # run as python -m CHILD
CALIBRATION_SAMPLES = 300  # NNCF's default subset size


def ensure_openvino(venv: Path, echo: Callable[[str], None]) -> dict[str, str]:
    """Install OpenVINO and NNCF into the (finished) peer environment once; their versions."""
    marker = venv / READY
    if marker.is_file():
        return dict(json.loads(marker.read_text()))
    echo(f"peers: installing {' and '.join(INSTALL)} into {venv} (once)")
    call([str(venv / "bin" / "pip"), "install", *INSTALL], f"pip install {' '.join(INSTALL)}",
         venv.parent / f"{venv.name}.log")
    facts = {name: version(venv, name) for name in INSTALL}
    marker.write_text(json.dumps(facts))
    return facts


def eval_file(recipe: Any, data: Any) -> dict[str, Any]:
    """What the child scores and calibrates on: the run's eval sentences and labels, and
    the first sentences of its calibration split (never the eval split)."""
    if "calibration" not in data.splits:
        raise PeerError("the run's recipe reads no calibration split to quantize OpenVINO's "
                        "int8 with")
    return {"texts": data.splits["eval"].texts, "labels": data.splits["eval"].labels,
            "calibration": data.splits["calibration"].texts[:CALIBRATION_SAMPLES],
            "max_length": data.max_length, "batch_size": recipe.evaluation.batch_size}


def build(run_dir: Path, fp32: Path, source_sha: str, recipe: Any, venv: Path,
          echo: Callable[[str], None], under: str = "peers") -> Path:
    """`<run>/<under>/openvino_int8/` built from Optimum's fp32 folder `fp32` (kept while
    `source_sha` is unchanged); the folder. A failed build raises PeerError."""
    folder = run_dir / under / NAME
    folder.parent.mkdir(parents=True, exist_ok=True)
    meta_path = folder / "build.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("source_sha256") == source_sha:
        echo("peers: OpenVINO int8 up to date (cached)")
        return folder
    data = load_data(recipe, resolve_data(recipe.data.source))
    tmp = Path(tempfile.mkdtemp(prefix=".build-ov-", dir=folder.parent))
    try:
        (tmp / "eval.json").write_text(json.dumps(eval_file(recipe, data)))
        echo(f"peers: NNCF int8 of {fp32.relative_to(run_dir)} in OpenVINO")
        answer = child(venv, {"mode": "build", "folder": str(tmp), "source": str(fp32)})
        if "error" in answer:
            raise PeerError(f"OpenVINO int8 build: {answer['error']}")
        (tmp / "build.json").write_text(json.dumps({**answer, "source_sha256": source_sha}))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def child(venv: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """The JSON line of the child run by the peer environment's Python."""
    return run_module(python_of(venv), CHILD, spec)


def openvino_item(run_dir: Path, fp32: Path, source_sha: str, venv: Path, flops: Any,
                  note: str, echo: Callable[[str], None], under: str = "peers",
                  name: str = NAME, runtime: str = LABEL, peer_of: str = "teacher"
                  ) -> dict[str, Any]:
    """The table item of OpenVINO's int8 of the model whose Optimum fp32 export is `fp32`
    (`peer_of`: "teacher" or "student", the weights it was made from), built under
    `<run>/<under>/`, or carrying the reason it could not be."""
    item = {"name": name, "runtime": runtime, "python": str(python_of(venv)), "child": CHILD,
            "source": str(fp32), "flops": flops, "flops_source": note,
            "size_mb": None, "peer": True, "peer_kind": NAME, "peer_of": peer_of,
            "rounds": []}
    try:
        facts = ensure_openvino(venv, echo)
        item["versions"] = facts
        folder = build(run_dir, fp32, source_sha, full_recipe(run_dir), venv, echo, under)
    except PeerError as exc:
        echo(f"peers: OpenVINO: {exc}")
        return {**item, "error": str(exc), "folder": str(run_dir / under / NAME)}
    built = json.loads((folder / "build.json").read_text())
    return {**item, "folder": str(folder), "size_mb": built.get("size_mb")}

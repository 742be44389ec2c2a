"""What benchmarks/embedding/peers.py times: compress's embedding exports of a finished run
(every export whose export.json says `"outputs": ["embedding"]` or has an `embedding`
block), and the peers a user would run instead on the same source model (the product rows)
and on our student's float weights (`student_<peer>`, the like-for-like rows: student.py),
their files built once per weights in `<run>/peers/embed/` by the peers' own environments
(venvs.py; the builds are child.py's build modes). A peer whose environment cannot be made
or lacks its library is not a row: it is listed as absent, with why."""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.embedding.venvs import ONNX, OPENVINO
from benchmarks.harness.machine import cpu_flags
from benchmarks.harness.rounds import run_module
from benchmarks.harness.venv import PeerError, Venv, ensure_venv
from compress.report.rebench import artifacts_of
from compress.report.runtimes import runtime_label
from compress.runfolder.records import Manifest

CHILD = "benchmarks.embedding.child"  # run as python -m CHILD
BUILT = "peers/embed"  # under the run folder
CALIBRATION_SAMPLES = 300  # OVQuantizationConfig's default


def quantize_config(flags: set[str], machine: str) -> str:
    """sentence-transformers' dynamic int8 config for this CPU: `avx512_vnni` where the CPU
    has it, `arm64` on ARM, else `avx2`."""
    if "avx512_vnni" in flags:
        return "avx512_vnni"
    return "arm64" if machine.lower() in ("aarch64", "arm64") else "avx2"


def is_embedding_export(folder: Path) -> dict[str, Any] | None:
    """The folder's export.json when it says `"outputs": ["embedding"]` or has an
    `embedding` block (an AOTInductor package of a PT2E int8 encoder, as compress 8046825
    writes it, names its output "logits" but carries the block), else None."""
    try:
        meta = json.loads((folder / "export.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    said = meta.get("outputs") == ["embedding"] or isinstance(meta.get("embedding"), dict)
    return meta if said else None


def compress_items(run_dir: Path, manifest: Manifest, one_pass: bool = False,
                   weights: dict[int, Path | None] | None = None,
                   student: Path | None = None) -> list[dict[str, Any]]:
    """One row per embedding export of the run, in stage order (its batches in passes of
    similar length, as the handlers run them, or for a packed file, `aoti_packed`, a batch
    in one pass of its real tokens); with `one_pass`, each padded file also as `NAME one
    pass`, a batch in one pass. Each says which float weights it was made from
    (`weights`: stage index -> folder, None for the source; student.py): "source",
    "student" (the folder `student`, whose config its FLOPs are counted from: `model`) or
    "other" (no like-for-like peers)."""
    weights = weights or {}
    items = []
    for artifact in artifacts_of(run_dir):
        folder = run_dir / artifact["folder"]
        meta = is_embedding_export(folder)
        if meta is None:
            continue
        file = folder / meta["file"]
        packed = bool(meta.get("aoti_packed"))
        items.append({"name": artifact["name"], "kind": "compress", "folder": str(folder),
                      "runtime": "compress " + runtime_label(manifest, artifact["index"],
                                                             artifact["config"]),
                      "python": None, "size_mb": _mb(file), "peer": False, "rounds": [],
                      "length_buckets": not packed, "packed": packed,
                      **_weights_of(weights.get(artifact["index"]), student)})
        if one_pass and not packed:
            items.append({**items[-1], "name": f"{artifact['name']} one pass",
                          "length_buckets": False, "rounds": []})
    return items


def _weights_of(folder: Path | None, student: Path | None) -> dict[str, Any]:
    """An export's "weights" ("source", "student" or "other") and, when not the source's,
    the float folder ("model") whose config.json counts its FLOPs."""
    if folder is None:
        return {"weights": "source"}
    return {"weights": "student" if student is not None and folder == student else "other",
            "model": str(folder)}


def _mb(path: Path) -> float | None:
    try:
        return round(path.stat().st_size / 2**20, 3)
    except OSError:
        return None


PEERS = ("st_fp32", "st_onnx_int8", "st_openvino_int8", "fastembed_fp32", "fastembed_int8")
STUDENT = "student_"  # a peer's row on our student's weights: its name with this prefix
# what each peer needs: (its environment, the package that environment must hold)
NEEDS = {"st_fp32": ("onnx", "sentence-transformers"),
         "st_onnx_int8": ("onnx", "sentence-transformers"),
         "st_openvino_int8": ("openvino", "openvino"),
         "fastembed_fp32": ("onnx", "fastembed"), "fastembed_int8": ("onnx", "fastembed")}
ENVIRONMENTS = {"onnx": ONNX, "openvino": OPENVINO}


def peer_of(name: str) -> str:
    """The peer a row name runs (`student_st_onnx_int8` -> `st_onnx_int8`)."""
    return name.removeprefix(STUDENT)


def peer_items(run_dir: Path, source: Path, source_sha: str, calibration: dict[str, Any] | None,
               layout: dict[str, Any], echo: Callable[[str], None], wanted: set[str],
               student: tuple[Path, str, dict[str, Any]] | None = None
               ) -> tuple[list[dict[str, Any]], dict[str, dict[str, str]],
                          list[dict[str, Any]]]:
    """(the `wanted` peers' rows, each built or carrying why its build failed; the versions
    in each environment used; the wanted rows that are absent: {"name", "reason": one line,
    "failed": whether an environment could not be made}).

    The peers run on the user's model (`source`, the product rows) and, with `student`
    ((folder, sha256 of its weights, its layout)), on our student's weights exported for
    each of them (`student_<peer>`, the like-for-like rows). A row whose environment cannot
    be made, or lacks its library (fastembed, OpenVINO), is absent with the reason.
    `calibration` ({"dataset": a folder of split files, "split", "column"}) calibrates
    OpenVINO's int8 (the same sentences for both models); None: that row says why not."""
    isa = quantize_config(cpu_flags(), platform.machine())
    versions: dict[str, dict[str, str]] = {}
    absent: list[dict[str, Any]] = []
    ready: dict[str, bool | str] = {}
    for env in dict.fromkeys(NEEDS[peer_of(n)][0] for n in wanted if peer_of(n) in NEEDS):
        ready[env] = _environment(ENVIRONMENTS[env], versions, echo)
    usable = set()
    for name in sorted(wanted, key=_order):
        env, package = NEEDS[peer_of(name)]
        venv = ENVIRONMENTS[env]
        if ready.get(env) is not True:
            absent.append({"name": name, "reason": str(ready.get(env)), "failed": True})
        elif versions[env].get(package, "-") == "-":
            absent.append({"name": name, "failed": False, "reason": (
                f"{package} is not installed in the peers' {env} environment (${venv.variable}"
                f", default {venv.default}): delete its marker {venv.marker} and the next "
                "run installs it")})
        else:
            usable.add(name)
    targets = [("", source, source_sha, layout)]
    if student is not None:
        targets.append((STUDENT, *student))
    rows = []
    for prefix, folder, sha, shape in targets:
        mine = {peer_of(n) for n in usable if n.startswith(prefix) and
                (prefix or not n.startswith(STUDENT))}
        rows += _rows_of(prefix, folder, sha, shape, mine, run_dir, isa, calibration,
                         versions, echo)
    return [{**row, "rounds": []} for row in rows], versions, absent


def _order(name: str) -> tuple[bool, int]:
    """Table order: the peers on the user's model, then on the student, each in PEERS'."""
    return name.startswith(STUDENT), PEERS.index(peer_of(name))


def _rows_of(prefix: str, folder: Path, sha: str, layout: dict[str, Any], peers: set[str],
             run_dir: Path, isa: str, calibration: dict[str, Any] | None,
             versions: dict[str, dict[str, str]], echo: Callable[[str], None]
             ) -> list[dict[str, Any]]:
    """The rows of `peers` on the weights in `folder` (`prefix` "" for the user's model,
    STUDENT for ours), their files built in `<run>/peers/embed/<prefix>st_onnx/` and
    `<prefix>st_openvino/`."""
    onnx: Any = "not wanted"
    if peers & {"st_onnx_int8", "fastembed_fp32", "fastembed_int8"}:
        onnx = _build(ONNX, run_dir, f"{prefix}st_onnx", folder, sha,
                      {"mode": "build_onnx", "isa": isa}, echo)
    openvino: Any = "not wanted"
    if "st_openvino_int8" in peers:
        openvino = "no local calibration split (set COMPRESS_DATA_DIR)"
        if calibration is not None:
            openvino = _build(OPENVINO, run_dir, f"{prefix}st_openvino", folder, sha, {
                "mode": "build_openvino",
                "calibration": {**calibration, "samples": CALIBRATION_SAMPLES}}, echo)
    st_onnx, st_ov, fastembed = (
        f"{package} {versions.get(env, {}).get(package, '?')}" for env, package in (
            ("onnx", "sentence-transformers"), ("openvino", "sentence-transformers"),
            ("onnx", "fastembed")))
    on = " on our student" if prefix else ""
    st = {"peer": True, **layout, "python": str(ONNX.python()), "kind": "st",
          "folder": str(folder), "size_mb": _mb(folder / "model.safetensors"),
          "weights": "student" if prefix else "source"}
    rows = [{**st, "name": "st_fp32", "runtime": f"{st_onnx} fp32 (torch){on}"},
            _peer(onnx, "int8", {**st, "name": "st_onnx_int8", "kind": "st_onnx",
                                 "runtime": f"{st_onnx} ONNX int8 dynamic ({isa}){on}"}),
            _peer(openvino, "int8", {**st, "python": str(OPENVINO.python()),
                                     "name": "st_openvino_int8", "kind": "st_openvino",
                                     "runtime": f"{st_ov} OpenVINO int8 static (NNCF){on}"}),
            _peer(onnx, "fp32", {**st, "name": "fastembed_fp32", "kind": "fastembed",
                                 "runtime": f"{fastembed} fp32 (ST's ONNX export){on}"}),
            _peer(onnx, "int8", {**st, "name": "fastembed_int8", "kind": "fastembed",
                                 "runtime": f"{fastembed} int8 (ST's {isa} file){on}"})]
    return [{**row, "name": prefix + row["name"]} for row in rows if row["name"] in peers]


def st_onnx_build(run_dir: Path, source: Path, echo: Callable[[str], None],
                  cross_encoder: bool = False) -> dict[str, Any] | str:
    """sentence-transformers' ONNX export and dynamic int8 of `source` for this CPU (the
    files peers.py times, built in the onnx environment or reused), or why not; with
    `cross_encoder`, a CrossEncoder's (rerank.py's, in `<run>/peers/embed/ce_onnx/`)."""
    from compress.runfolder.files import sha256_file

    versions: dict[str, dict[str, str]] = {}
    ready = _environment(ONNX, versions, echo)
    if ready is not True:
        return str(ready)
    isa = quantize_config(cpu_flags(), platform.machine())
    spec: dict[str, Any] = {"mode": "build_onnx", "isa": isa}
    if cross_encoder:
        spec["cross_encoder"] = True
    return _build(ONNX, run_dir, "ce_onnx" if cross_encoder else "st_onnx", source,
                  sha256_file(source / "model.safetensors"), spec, echo)


def _peer(built: Any, key: str, item: dict[str, Any]) -> dict[str, Any]:
    """`item` on the built folder's `key` file, or carrying the build's failure."""
    if not isinstance(built, dict):
        return {**item, "error": str(built), "size_mb": None}
    return {**item, "folder": built["folder"], "file": built["files"][key],
            "size_mb": built["size_mb"][key]}


def _environment(venv: Venv, versions: dict[str, dict[str, str]],
                 echo: Callable[[str], None]) -> bool | str:
    """True when `venv` is ready (its versions in `versions[venv.name]`), else why not."""
    try:
        versions[venv.name] = ensure_venv(venv, echo)
        return True
    except PeerError as exc:
        echo(f"peers_embed: the {venv.name} environment: {exc}")
        return f"{venv.name} environment: {exc}"


def _build(venv: Venv, run_dir: Path, name: str, source: Path, source_sha: str,
           spec: dict[str, Any], echo: Callable[[str], None]) -> dict[str, Any] | str:
    """`<run>/peers/embed/<name>/` built by the child in `venv` (kept while the source's
    weights are unchanged); its build record, or why it could not be made."""
    folder = run_dir / BUILT / name
    record = folder / "build.json"
    try:
        built = json.loads(record.read_text())
        if built.get("source_sha256") == source_sha and built.get("spec") == spec:
            echo(f"peers_embed: {name} up to date (cached)")
            return {**built, "folder": str(folder)}
    except (OSError, ValueError):
        pass
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{name}-", dir=folder.parent))
    echo(f"peers_embed: building {name} in the {venv.name} environment (once per source)")
    try:
        answer = run_module(venv.python(), CHILD,
                            {**spec, "source": str(source), "folder": str(tmp / "model")})
        if "error" in answer:
            echo(f"peers_embed: {name}: {answer['error']}")
            return f"{name} build: {answer['error']}"
        built = {**answer, "spec": spec, "source_sha256": source_sha}
        (tmp / "model" / "build.json").write_text(json.dumps(built, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp / "model", folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**built, "folder": str(folder)}

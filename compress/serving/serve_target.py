"""What `compress serve` serves: a run folder's archive (the latest finished package stage's,
checked against the manifest) or a bare `.mar`, its model name, the serve folder beside it,
and the archive unpacked into the model store with the command line's overrides.

TorchServe and LitServe (compress.serving.server, compress.serving.litserve) serve the
unpacked folder alike.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from compress.errors import UserError
from compress.runfolder.files import sha256_file
from compress.runfolder.records import MANIFEST, require_manifest
from serve.worker_threads import worker_threads

MODEL_NAME = re.compile(r"[A-Za-z0-9_.-]+")


@dataclass(frozen=True)
class ServeTarget:
    """The archive to serve, its model name and the folder the server keeps its files in."""

    mar: Path
    model_name: str
    serve_dir: Path


def resolve_target(path: str | Path) -> ServeTarget:
    """A run folder or a `.mar` file, as a ServeTarget. In a run folder it is the archive of
    the latest finished stage whose first output is a `.mar` (read through the typed
    manifest, so a corrupt manifest is a one-line UserError)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".mar":
        return ServeTarget(path.resolve(), _checked_name(_mar_model_name(path), path),
                           path.resolve().with_suffix(".serve"))
    if not (path / MANIFEST).is_file():
        raise UserError(f"{path}: neither a run folder (no {MANIFEST}) nor a .mar file")
    manifest = require_manifest(path)
    archives = [(s, s.outputs[0]) for s in manifest.stages
                if s.finished_ok and s.outputs and s.outputs[0].format == "mar"]
    if not archives:
        raise UserError(f"{path}: the run has no finished package stage; add "
                        f"{{kind: package}} after an export stage and run the recipe again")
    stage, record = archives[-1]
    mar = (path / (record.path or "")).resolve()
    if not record.path or not mar.is_file():
        raise UserError(f"{mar}: the archive of stage {stage.name} (stages.{stage.index}) is "
                        f"missing; run the recipe again to make it")
    if sha256_file(mar) != record.sha256:
        raise UserError(f"{mar}: the archive changed since the run packaged it (its sha256 is "
                        f"not the manifest's); package it again: compress run RECIPE "
                        f"--from-stage {stage.index}")
    model_name = getattr(record, "model_name", None) or _mar_model_name(mar)
    return ServeTarget(mar, _checked_name(model_name, mar), path.resolve() / "serve")


def _checked_name(name: Any, mar: Path) -> str:
    """`name` when it is safe as a file name and a URL part, else a UserError."""
    if not isinstance(name, str) or not MODEL_NAME.fullmatch(name) or name in (".", ".."):
        raise UserError(f"{mar}: model name {name!r} is not allowed: use letters, digits, "
                        f"'_', '-' and '.' only")
    return name


def _mar_model_name(mar: Path) -> str:
    try:
        with zipfile.ZipFile(mar) as archive:
            manifest = json.loads(archive.read("MAR-INF/MANIFEST.json"))
        return manifest["model"]["modelName"]
    except (zipfile.BadZipFile, KeyError, json.JSONDecodeError) as exc:
        raise UserError(f"{mar}: not a TorchServe archive ({exc})") from None


def unpack_model(target: ServeTarget, store: Path, workers: int | None,
                 batch_size: int | None, max_batch_delay_ms: int | None,
                 threads: int | None = None) -> dict[str, Any]:
    """Unpack the archive into the model store and apply the command line's overrides to
    its model-config.yaml; return the settings in force."""
    folder = store / target.model_name
    with zipfile.ZipFile(target.mar) as archive:
        archive.extractall(folder)
    config_file = folder / "model-config.yaml"
    config = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {}
    if workers is not None:
        config["minWorkers"] = config["maxWorkers"] = workers
    if batch_size is not None:
        config["batchSize"] = batch_size
    if max_batch_delay_ms is not None:
        config["maxBatchDelay"] = max_batch_delay_ms
    handler = config.setdefault("handler", {})
    handler["threads"] = worker_threads(threads or handler.get("threads"),
                                        int(config.get("maxWorkers", 1)))
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    return {k: config.get(k) for k in ("minWorkers", "maxWorkers", "batchSize",
                                       "maxBatchDelay", "responseTimeout")} | {
        "threads_per_worker": handler["threads"],
        "task": handler.get("task", "classification"),
        # a continuous batch's decode rows (each request joins it; batch size 1), else None
        "continuous_rows": (int(handler.get("rows") or config.get("batchSize") or 1)
                            if config.get("asyncCommunication") else None)}


def refuse_parallel_archive(mar: Path, model_dir: Path) -> dict[str, Any]:
    """The unpacked archive's model-config.yaml; a UserError for a parallelType archive,
    whose workers are torchrun jobs that only TorchServe starts (LitServe and Ray refuse
    it alike)."""
    config = yaml.safe_load((model_dir / "model-config.yaml").read_text()) or {}
    refuse_parallel_config(mar, config)
    return config


def refuse_parallel_config(mar: Path, config: dict[str, Any]) -> None:
    """A UserError when the archive's model-config (`config`) is a parallelType one."""
    if config.get("parallelType"):
        raise UserError(f"{mar}: a parallelType: {config['parallelType']} archive runs each "
                        f"worker as a torchrun job, which only TorchServe starts: serve it "
                        f"with --engine torchserve")

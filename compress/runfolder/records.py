"""Typed run-folder records: `Manifest`, `StageRecord`, `Artifact` (no torch import).

`manifest.json` is the truth about a run folder. It is read through `read_manifest` /
`require_manifest` and written through `write_manifest` only; pipeline, `compress bench`,
the report, the server and the benchmarks all use these types. A record keeps exactly the
keys it was given (`exclude_unset`), so a manifest read and written back is unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from compress.errors import UserError
from compress.runfolder.files import atomic_write_json, fsync_tree, sha256_file

MANIFEST = "manifest.json"
FINISHED = ("done", "cached")  # a stage in one of these states has its outputs on disk


class Record(BaseModel):
    """Base of the records: extra keys kept (newer or older writers), assignment allowed."""

    model_config = ConfigDict(extra="allow")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_unset=True)


class Artifact(Record):
    """A file a stage wrote (or, as an input, the digest of the recipe's model)."""

    path: str | None = None  # relative to the run folder
    format: str
    sha256: str
    bytes: int | None = None
    model_dir: str | None = None  # a saved model's folder (loadable by models.load_saved)
    export_dir: str | None = None  # an export's folder (loadable by export.folder)


def artifact_record(path: Path, run_dir: Path, fmt: str, **extra: Any) -> Artifact:
    """The record of a file inside the run folder: path, format, sha256, bytes. The file
    (and its `model_dir` / `export_dir` folder) is fsynced first: a manifest that names
    an artifact is never on disk before the artifact itself."""
    for folder in (extra.get("model_dir"), extra.get("export_dir")):
        if folder:
            fsync_tree(run_dir / folder)
    fsync_tree(path)
    return Artifact(path=str(path.relative_to(run_dir)), format=fmt, sha256=sha256_file(path),
                    bytes=path.stat().st_size, **extra)


def artifact_intact(record: Artifact, run_dir: Path) -> bool:
    """True when the recorded artifact is on disk with the recorded size and sha256."""
    if record.path is None:
        return False
    path = run_dir / record.path
    return (path.is_file() and path.stat().st_size == record.bytes
            and sha256_file(path) == record.sha256)


class StageRecord(Record):
    """One stage of a run: what went in, what came out, what was measured."""

    index: int
    name: str
    kind: str
    status: str  # running, done, cached, failed
    key: str | None = None
    config: dict[str, Any] = {}
    started: str | None = None
    finished: str | None = None
    inputs: list[Artifact] = []
    outputs: list[Artifact] = []
    metrics: dict[str, Any] = {}
    wall_time_s: float | None = None
    error: str | None = None

    @property
    def finished_ok(self) -> bool:
        return self.status in FINISHED


class Baseline(Record):
    """The model before any stage, measured."""

    status: str
    key: str | None = None
    metrics: dict[str, Any] = {}
    wall_time_s: float | None = None


class Manifest(Record):
    """A run folder's manifest."""

    name: str = ""
    created: str | None = None
    updated: str | None = None
    recipe: dict[str, Any] = {}
    environment: dict[str, Any] = {}
    labels: dict[str, Any] = {}
    data: dict[str, Any] = {}
    model: dict[str, Any] = {}  # the model family and where its weights came from
    baseline: Baseline | None = None
    stages: list[StageRecord] = []

    def latency_settings(self) -> dict[str, Any]:
        """The recipe's `evaluation.latency` section as recorded."""
        return ((self.recipe.get("evaluation") or {}).get("latency")) or {}

    def recipe_stages(self) -> list[dict[str, Any]]:
        """The recipe's stage configs as recorded."""
        return list(self.recipe.get("stages") or [])

    def entry(self, index: int | None) -> StageRecord | Baseline | None:
        """Stage `index`'s record (None: the baseline)."""
        if index is None:
            return self.baseline
        return self.stages[index] if 0 <= index < len(self.stages) else None


def read_manifest(run_dir: str | Path) -> Manifest | None:
    """The run's manifest, or None when there is none or it cannot be read."""
    try:
        return _load(Path(run_dir))
    except UserError:
        return None


def require_manifest(run_dir: str | Path) -> Manifest:
    """The run's manifest, or a UserError saying what is wrong with the folder."""
    run_dir = Path(run_dir)
    if not (run_dir / MANIFEST).is_file():
        raise UserError(f"{run_dir}: no {MANIFEST}; is it a run folder? (compress run "
                        f"RECIPE makes one)")
    return _load(run_dir)


def _load(run_dir: Path) -> Manifest:
    path = run_dir / MANIFEST
    if not path.is_file():
        raise UserError(f"{run_dir}: no {MANIFEST}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: unreadable ({type(exc).__name__}); run the recipe again "
                        f"to rewrite it") from None
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "top level"
        raise UserError(f"{path}: not a compress manifest ({where}: {first['msg']}); run the "
                        f"recipe again to rewrite it") from None


def write_manifest(run_dir: str | Path, manifest: Manifest) -> None:
    """Write the manifest atomically (a temporary file, then a rename)."""
    atomic_write_json(Path(run_dir) / MANIFEST, manifest.to_json())

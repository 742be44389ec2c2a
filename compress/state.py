"""What flows between stages (`State`) and what a stage is given (`StageContext`).

The contract of every stage kind: `run(state, cfg, ctx) -> state`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compress.data import DataBundle
from compress.models import ModelBundle, save_model
from compress.runfolder import artifact_record


@dataclass
class State:
    """The current model (with tokenizer and labels) and the artifacts produced so far.

    `bundle` is None for a stage that takes files, not a model (package)."""

    bundle: ModelBundle | None
    artifacts: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class StageContext:
    """A stage's own folder, the data, the recipe, its cache key and where to report."""

    index: int
    name: str
    folder: Path
    run_dir: Path
    recipe: Any
    data: DataBundle
    key: str
    seed: int
    log: Callable[[str], None] = print
    outputs: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def checkpoint_dir(self) -> Path:
        return self.folder / "checkpoints"

    def save_model(self, bundle: ModelBundle, name: str = "model") -> dict[str, Any]:
        """Write `bundle` to `<stage folder>/<name>/` atomically and record it as an output
        (rank 0 only: under torchrun the other ranks write nothing)."""
        from compress import distributed

        if not distributed.is_main():
            return {}
        final = self.folder / name
        tmp = self.folder / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        weights = save_model(bundle, tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        fmt = "pt2" if weights.suffix == ".pt2" else "safetensors"
        record = artifact_record(final / weights.name, self.run_dir, fmt)
        record["model_dir"] = str(final.relative_to(self.run_dir))
        self.outputs.append(record)
        return record

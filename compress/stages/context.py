"""What flows between stages (`State`) and what a stage is given (`StageContext`).

The contract of every stage kind: `run(state, cfg, ctx) -> state`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compress.data.datasets import DataBundle
from compress.models.bundle import ModelBundle
from compress.models.folders import save_model
from compress.runfolder.records import Artifact, Manifest, StageRecord, artifact_record
from compress.train.loop import TrainSetup


@dataclass
class State:
    """What enters a stage: the current model (with tokenizer and labels), the artifacts
    it was saved as, and for a stage that takes an earlier stage's file instead of a model
    (`bundle` None) that stage's record."""

    bundle: ModelBundle | None
    artifacts: list[Artifact] = field(default_factory=list)
    source: StageRecord | None = None


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
    manifest: Manifest | None = None  # the run so far (read only)
    input_sha: str = ""  # sha256 of what entered the stage (its model's file, or the source's)
    outputs: list[Artifact] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def checkpoint_dir(self) -> Path:
        return self.folder / "checkpoints"

    def training(self, desc: str | None = None, seed: int | None = None) -> TrainSetup:
        """The train split, checkpoints and telemetry in this stage's folder, the cache key and
        seed."""
        return TrainSetup(self.data.splits["train"], self.data.max_length,
                          self.seed if seed is None else seed, self.checkpoint_dir, self.key,
                          desc or self.name, self.folder / "tensorboard")

    def add_output(self, record: Artifact) -> Artifact:
        """Record a file the stage wrote as its output: the one way a stage reports one
        (the first output is the stage's artifact)."""
        self.outputs.append(record)
        return record

    def save_model(self, bundle: ModelBundle, name: str = "model") -> Artifact | None:
        """Write `bundle` to `<stage folder>/<name>/` atomically and record it as an output
        (rank 0 only: under torchrun the other ranks write nothing and get None)."""
        from compress.distributed import process_group

        if not process_group.is_main():
            return None
        final = self.folder / name
        tmp = self.folder / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        weights = save_model(bundle, tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        fmt = {".pt2": "pt2", ".pt": "pt"}.get(weights.suffix, "safetensors")
        record = artifact_record(final / weights.name, self.run_dir, fmt,
                                 model_dir=str(final.relative_to(self.run_dir)))
        return self.add_output(record)

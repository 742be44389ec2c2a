"""Datasets: text tables (TSV/CSV/JSONL, the hub) and scikit-learn digits, split and batched.

Text batches are tokenized per batch and padded to their longest item, not to a fixed length.
Text pairs (a reranker's query and document) are tokenized as one input each,
`tokenizer(texts, pairs)`: the first text's tokens, then the second's (token types 0 and 1
where the model has them), cut longest-first at the split's max length, as
sentence-transformers' CrossEncoder tokenizes them.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch

from compress.errors import UserError
from compress.recipe.chain import used_splits
from compress.recipe.datasets import DataSource, split_file


@dataclass
class Examples:
    """One split: texts (text tasks) or a tensor of inputs (image tasks), and label ids.
    `pairs`, where given, is the second text of each example (a reranker's document to the
    query in `texts`): every batch then holds both texts of each pair."""

    labels: list[int]
    texts: list[str] | None = None
    inputs: torch.Tensor | None = None
    pairs: list[str] | None = None

    def __len__(self) -> int:
        return len(self.texts) if self.texts is not None else len(self.labels)

    def head(self, n: int) -> Examples:
        """The first `n` examples."""
        return self.subset(list(range(min(n, len(self)))))

    def subset(self, idx: list[int]) -> Examples:
        """The examples at `idx`, in that order."""
        def pick(values):
            return None if values is None else [values[i] for i in idx]

        return Examples(labels=[self.labels[i] for i in idx] if self.labels else [],
                        texts=pick(self.texts),
                        inputs=None if self.inputs is None else self.inputs[idx],
                        pairs=pick(self.pairs))


@dataclass
class DataBundle:
    """The splits a recipe uses, with the label names and any string-label mapping."""

    task: str  # "text", "image" or "causal-lm"
    splits: dict[str, Examples]
    label_names: list[str]
    label_mapping: dict[str, int] | None = None
    max_length: int = 128
    input_shape: list[int] = field(default_factory=list)
    prompts: list[Any] = field(default_factory=list)  # causal LMs: str or chat messages

    @property
    def num_labels(self) -> int:
        return len(self.label_names)


def load_data(recipe, source: DataSource, labels_required: bool = True) -> DataBundle:
    """Load every split the recipe uses (eval always; train/calibration when a stage needs
    them). With `labels_required` False, data without the label column loads as texts only
    (no labels, no label names)."""
    cfg = recipe.data
    names = used_splits(recipe)
    if source.kind == "digits":
        return _load_digits(recipe, names)
    rows: dict[str, list[dict[str, Any]]] = {}
    for name in names:
        split = getattr(cfg, name)
        if source.kind == "files":
            table = read_table(split_file(source.location, split.split))
        else:
            table = read_hub_split(source.location, split.split)
        _check_row_columns(table, cfg, name, labels_required)
        rows[name] = seeded_subset(table, split.max_samples, recipe.seed)
    labelled = labels_required or all(cfg.label_column in rows[n][0] for n in names)
    mapping, label_names = None, []
    if labelled:
        raw_labels = [r[cfg.label_column] for name in names for r in rows[name]]
        mapping, label_names = _label_ids(raw_labels, cfg.label_names)
    splits = {}
    for name in names:
        labels = ([_to_id(r[cfg.label_column], mapping) for r in rows[name]] if labelled
                  else [])
        texts = [str(r[cfg.text_column]) for r in rows[name]]
        splits[name] = Examples(labels=labels, texts=texts)
    return DataBundle("text", splits, label_names, mapping, cfg.max_length)


def read_table(path: Path) -> list[dict[str, Any]]:
    """The rows of a TSV, CSV or JSONL table."""
    with open(path, encoding="utf-8", newline="") as fh:
        if path.suffix == ".jsonl":
            try:
                return [json.loads(line) for line in fh if line.strip()]
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{exc.lineno}: not a JSON object per line") from None
        if path.suffix == ".tsv":
            return list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
        return list(csv.DictReader(fh))


def read_hub_split(dataset_id: str, split: str) -> list[dict[str, Any]]:
    """The rows of one split of a Hugging Face hub dataset (the `datasets` package)."""
    try:
        import datasets

        return list(datasets.load_dataset(dataset_id, split=split))
    except Exception as exc:  # network, unknown id, unknown split
        raise UserError(
            f"data.source: dataset '{dataset_id}' split '{split}' not found in "
            f"COMPRESS_DATA_DIR nor on the hub ({type(exc).__name__}); point "
            "COMPRESS_DATA_DIR at a folder holding <id>/<split>.tsv"
        ) from None


def _check_row_columns(table: list[dict[str, Any]], cfg, split_name: str,
                       labels_required: bool = True) -> None:
    if not table:
        raise UserError(f"data.{split_name}: split '{getattr(cfg, split_name).split}' is empty")
    for option in ("text_column", "label_column") if labels_required else ("text_column",):
        column = getattr(cfg, option)
        if column not in table[0]:
            raise UserError(
                f"data.{option}: column '{column}' not found (columns: {', '.join(table[0])})"
            )


def seeded_subset(rows: list[Any], max_samples: int | None, seed: int) -> list[Any]:
    """`max_samples` of `rows` picked with `seed`, in their order (all when None)."""
    if max_samples is None or max_samples >= len(rows):
        return rows
    picked = sorted(random.Random(seed).sample(range(len(rows)), max_samples))
    return [rows[i] for i in picked]


def _label_ids(raw: list[Any], names: list[str] | None) -> tuple[dict[str, int] | None, list[str]]:
    """Integer labels stay as they are; string labels map to ids (by `names` or sorted)."""
    if all(_is_int(v) for v in raw):
        count = max(int(v) for v in raw) + 1
        if names is not None and len(names) < count:
            raise UserError(
                f"data.label_names: {len(names)} names for labels 0..{count - 1}; give {count}"
            )
        return None, list(names) if names else [str(i) for i in range(count)]
    values = sorted({str(v) for v in raw})
    order = list(names) if names else values
    unknown = [v for v in values if v not in order]
    if unknown:
        raise UserError(f"data.label_names: labels {unknown} are not among {order}")
    return {name: i for i, name in enumerate(order)}, order


def _is_int(value: Any) -> bool:
    try:
        return int(value) == float(value) and int(value) >= 0
    except (TypeError, ValueError):
        return False


def _to_id(value: Any, mapping: dict[str, int] | None) -> int:
    return int(value) if mapping is None else mapping[str(value)]


@cache
def _digits() -> tuple[Any, tuple[int, ...]]:
    """scikit-learn's digits (pixels, labels), read once a process from the CSV that
    scikit-learn ships, without importing it: its import (scipy, pandas) took about 2.5 s of
    CPU in every process that trained or evaluated on digits. Through scikit-learn's loader
    where the file is not where it was."""
    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("data.source sklearn:digits needs scikit-learn: pip install scikit-learn")
    table = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if table.is_file():
        values = np.loadtxt(table, delimiter=",")
        return values[:, :-1], tuple(int(v) for v in values[:, -1])
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.data, tuple(int(v) for v in digits.target)


def stratified_split(labels: list[int], fraction: float, seed: int
                     ) -> tuple[list[int], list[int]]:
    """Indices (kept, held out) of a seeded split that holds out `fraction` of each class:
    ceil(fraction x n) in all, shared among the classes by their sizes (the largest
    remainders take the rounding), each class's picked at random with `seed`."""
    rng = random.Random(seed)
    members: dict[int, list[int]] = {}
    for index, label in enumerate(labels):
        members.setdefault(label, []).append(index)
    wanted = math.ceil(fraction * len(labels))
    exact = {c: wanted * len(rows) / len(labels) for c, rows in members.items()}
    counts = {c: math.floor(share) for c, share in exact.items()}
    by_remainder = sorted(members, key=lambda c: (counts[c] - exact[c], c))
    for c in by_remainder[:wanted - sum(counts.values())]:
        counts[c] += 1
    kept, held = [], []
    for c in sorted(members):
        rows = members[c][:]
        rng.shuffle(rows)
        held += rows[:counts[c]]
        kept += rows[counts[c]:]
    rng.shuffle(kept)
    rng.shuffle(held)
    return kept, held


def _load_digits(recipe, names: list[str]) -> DataBundle:
    cfg = recipe.data
    pixels, labels = _digits()
    x = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = list(labels)
    train_idx, held_idx = stratified_split(y, cfg.holdout_fraction, recipe.seed)
    parts = {"train": train_idx}
    for alias in ("test", "validation", "eval", "holdout"):
        parts[alias] = held_idx
    splits = {}
    for name in names:
        split = getattr(cfg, name)
        if split.split not in parts:
            raise UserError(
                f"data.{name}.split: digits has splits 'train' and 'test', not '{split.split}'"
            )
        idx = seeded_subset(parts[split.split], split.max_samples, recipe.seed)
        splits[name] = Examples(labels=[y[i] for i in idx], inputs=x[idx])
    label_names = cfg.label_names or [str(i) for i in range(10)]
    return DataBundle("image", splits, label_names, None, cfg.max_length, [1, 8, 8])


def collate(examples: Examples, idx: list[int], tokenizer, max_length: int) -> tuple[Any, Any]:
    """Inputs and label tensor for the examples at `idx` (text padded to the batch's longest,
    each pair as one input; an empty tensor for unlabelled text)."""
    labels = torch.tensor([examples.labels[i] for i in idx] if examples.labels else [],
                          dtype=torch.long)
    if examples.texts is None:
        return examples.inputs[idx], labels
    second = None if examples.pairs is None else [examples.pairs[i] for i in idx]
    encoded = tokenizer(
        [examples.texts[i] for i in idx], second, padding=True, truncation=True,
        max_length=max_length, return_tensors="pt",
    )
    return dict(encoded), labels


def iterate(examples: Examples, batch_size: int, tokenizer, max_length: int,
            order: list[int] | None = None) -> Iterator[tuple[Any, Any]]:
    """Batches over `examples` in `order` (default: as stored)."""
    order = list(range(len(examples))) if order is None else order
    for start in range(0, len(order), batch_size):
        yield collate(examples, order[start:start + batch_size], tokenizer, max_length)

"""Datasets of the local lm-eval tasks beside this file, read from the mirror that
`COMPRESS_DATA_DIR` points at (`<hub id>/<split>.tsv`: a header line, tab-separated, no
quoting), so that a task runs with no network. lm-eval imports this file by its task
YAML's `custom_dataset: !function local_data.<name>`."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any


def sst2(**_: Any) -> Any:
    """SST-2's validation split (872 sentences, label 0 negative, 1 positive) as a
    `datasets.DatasetDict` of one split, `validation`."""
    import datasets

    folder = os.environ.get("COMPRESS_DATA_DIR")
    path = Path(folder or ".") / "stanfordnlp" / "sst2" / "validation.tsv"
    if not folder or not path.is_file():
        raise FileNotFoundError(f"{path} not found: point COMPRESS_DATA_DIR at the folder "
                                "holding stanfordnlp/sst2/validation.tsv")
    with path.open(encoding="utf-8", newline="") as file:
        rows = list(csv.DictReader(file, delimiter="\t", quoting=csv.QUOTE_NONE))
    return datasets.DatasetDict({"validation": datasets.Dataset.from_dict({
        "sentence": [row["sentence"] for row in rows],
        "label": [int(row["label"]) for row in rows]})})

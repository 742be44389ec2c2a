"""Data sources: tables in three formats, string labels, subsets, digits, per-batch padding."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, write_sentiment_tables

from compress.data.datasets import load_data, stratified_split
from compress.errors import UserError
from compress.recipe.datasets import resolve_data
from compress.recipe.schema import Recipe
from compress.recipe.sources import check_recipe_sources


def _recipe(source: str, **data) -> Recipe:
    return Recipe.model_validate({
        "name": "t", "model": {"source": "compress.models.zoo:mlp"},
        "data": {"source": source, "text_column": "sentence", **data},
        "stages": [{"kind": "finetune"}]})


@pytest.mark.parametrize("suffix", [".tsv", ".csv", ".jsonl"])
def test_tables_in_every_format(tmp_path: Path, suffix: str) -> None:
    folder = write_sentiment_tables(tmp_path / "d", n_train=40, n_eval=10, suffix=suffix)
    recipe = _recipe(str(folder))
    data = load_data(recipe, resolve_data(str(folder)))
    assert data.task == "text" and data.label_names == ["0", "1"]
    assert len(data.splits["train"]) == 40 and len(data.splits["eval"]) == 10
    assert data.splits["train"].labels[:4] == [0, 1, 0, 1]
    assert data.splits["eval"].texts[0].endswith("movie") or "movie" in data.splits["eval"].texts[0]


def test_string_labels_map_to_ids_in_label_names_order(tmp_path: Path) -> None:
    folder = write_sentiment_tables(tmp_path / "d", n_train=20, n_eval=6, string_labels=True)
    recipe = _recipe(str(folder), label_names=["positive", "negative"])
    data = load_data(recipe, resolve_data(str(folder)))
    assert data.label_mapping == {"positive": 0, "negative": 1}
    assert data.splits["train"].labels[:2] == [1, 0]  # row 0 is negative


def test_unknown_string_label_is_a_user_error(tmp_path: Path) -> None:
    folder = write_sentiment_tables(tmp_path / "d", n_train=20, n_eval=6, string_labels=True)
    with pytest.raises(UserError, match="labels \\['positive'\\] are not among"):
        load_data(_recipe(str(folder), label_names=["negative", "neutral"]),
                  resolve_data(str(folder)))


def test_max_samples_is_a_seeded_subset(tmp_path: Path) -> None:
    folder = write_sentiment_tables(tmp_path / "d", n_train=100, n_eval=10)
    source = resolve_data(str(folder))
    pick = {"train": {"split": "train", "max_samples": 30}}
    a = load_data(_recipe(str(folder), **pick), source).splits["train"]
    b = load_data(_recipe(str(folder), **pick), source).splits["train"]
    assert len(a) == 30 and a.texts == b.texts


def test_digits_holdout_is_stratified_and_disjoint() -> None:
    recipe = Recipe.model_validate({
        "name": "d", "model": {"source": "compress.models.zoo:mlp"},
        "data": {"source": "sklearn:digits", "eval": {"split": "test"}},
        "stages": [{"kind": "finetune"}]})
    data = load_data(recipe, resolve_data("sklearn:digits"))
    train, held = data.splits["train"], data.splits["eval"]
    assert len(train) + len(held) == 1797 and len(held) == 360
    assert train.inputs.shape[1:] == (1, 8, 8) and data.input_shape == [1, 8, 8]
    assert float(train.inputs.max()) <= 1.0
    assert set(held.labels) == set(range(10))
    train_rows = {tuple(x.flatten().tolist()) for x in train.inputs}
    overlap = sum(tuple(x.flatten().tolist()) in train_rows for x in held.inputs)
    assert overlap < 10  # digits holds a few duplicate images; the split itself is disjoint
    counts = Counter(held.labels)  # each class held out by its share, to within one
    everyone = Counter(train.labels) + counts
    assert all(abs(counts[c] - 0.2 * everyone[c]) <= 1 for c in range(10)), counts


def test_digits_are_scikit_learn_s_read_without_importing_it() -> None:
    """The CSV scikit-learn ships, read as its loader reads it, in a process that never
    imports scikit-learn (whose import cost every digits process about 2.5 s)."""
    code = ("import sys; from compress.data.datasets import _digits; x, y = _digits(); "
            "print(x.shape, len(y), 'sklearn' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, check=True)
    assert done.stdout.split() == ["(1797,", "64)", "1797", "False"]
    from sklearn.datasets import load_digits

    from compress.data.datasets import _digits

    pixels, labels = _digits()
    digits = load_digits()
    assert np.array_equal(pixels, digits.data) and labels == tuple(digits.target.tolist())


def test_a_stratified_split_holds_out_each_class_s_share_with_its_seed() -> None:
    labels = [0] * 50 + [1] * 31 + [2] * 7 + [3] * 2
    kept, held = stratified_split(labels, 0.25, seed=3)
    assert sorted(kept + held) == list(range(90)) and len(held) == 23  # ceil(0.25 x 90)
    shares = Counter(labels[i] for i in held)
    assert shares == {0: 13, 1: 8, 2: 2}, shares  # 12.78, 7.92, 1.79, 0.51: largest remainders
    assert stratified_split(labels, 0.25, seed=3) == (kept, held)
    assert stratified_split(labels, 0.25, seed=4)[1] != held


def test_wrong_split_name_is_reported_before_any_work(tmp_path: Path) -> None:
    folder = write_sentiment_tables(tmp_path / "d", n_train=10, n_eval=4)
    recipe = _recipe(str(folder), eval={"split": "test"})
    with pytest.raises(UserError) as info:
        check_recipe_sources(recipe)
    assert "data.eval.split: split 'test' not found" in info.value.messages[0]
    assert "train.tsv, validation.tsv" in info.value.messages[0]

"""A request's texts read into token rows (`serve.batching.token_rows`) and a pass's rows
padded into tensors (`padded`): a fast tokenizer's rows come from its Rust tokenizer and
must be exactly what the tokenizer's own call gives, whatever state an earlier call left."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from compress.recipe.sources import resolve_model
from serve.batching import padded, token_rows

NAMES = ["input_ids", "attention_mask", "token_type_ids"]
TEXTS = ["", "Hello wörld ", "a " * 300, "naïve café, 東京 🙂", "The plot\tis\nthin."]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(
        resolve_model("sentence-transformers/all-MiniLM-L6-v2", None).location)


def called(tokenizer, texts: list[str], max_length: int) -> list[list[list[int]]]:
    encoded = tokenizer(texts, truncation=True, max_length=max_length)
    return [[encoded[name][r] for name in NAMES] for r in range(len(texts))]


@pytest.mark.parametrize("max_length", [6, 128, 512])
def test_rows_are_the_tokenizers_own_answer(tokenizer, max_length: int) -> None:
    assert tokenizer.is_fast
    rows = token_rows(tokenizer, TEXTS, max_length, NAMES)
    assert rows == called(tokenizer, TEXTS, max_length)
    assert max(len(row[0]) for row in rows) == min(max_length, 302)  # 300 words, CLS, SEP


def test_truncation_side_and_an_earlier_padded_call_are_honoured(tokenizer) -> None:
    tokenizer(TEXTS, padding="max_length", max_length=40, truncation=True)  # leaves padding on
    rows = token_rows(tokenizer, TEXTS, 8, NAMES)
    assert [len(row[0]) for row in rows] == [2, 4, 8, 8, 7]  # unpadded
    assert rows == called(tokenizer, TEXTS, 8)
    tokenizer.truncation_side = "left"
    try:
        left = token_rows(tokenizer, ["one two three four five six seven eight nine"], 5, NAMES)
        assert left == called(tokenizer, ["one two three four five six seven eight nine"], 5)
        assert tokenizer.decode(left[0][0]) == "[CLS] seven eight nine [SEP]"
    finally:
        tokenizer.truncation_side = "right"


def test_a_tokenizer_without_rust_is_called_and_missing_inputs_are_filled() -> None:
    class Plain:
        is_fast = False

        def __call__(self, texts, truncation, max_length):
            return {"input_ids": [[7] * min(len(t), max_length) for t in texts]}

    rows = token_rows(Plain(), ["abc", "abcdefgh"], 5, NAMES)
    assert rows == [[[7] * 3, [1] * 3, [0] * 3], [[7] * 5, [1] * 5, [0] * 5]]


def test_rows_are_padded_to_the_longest_as_int64() -> None:
    rows = [[[5, 6, 7], [1, 1, 1]], [[8], [1]]]
    ids, mask = padded(rows, 0, ["input_ids", "attention_mask"])
    assert ids.dtype == torch.long and ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    ids, _ = padded(rows, 9, ["input_ids", "attention_mask"], left=True)
    assert ids.tolist() == [[5, 6, 7], [9, 9, 8]]

"""Issue 71 item 4's data layer: `Examples.pairs`, the second text of each example (a
reranker's document), travels through `head`, `subset` and every batch (`collate`,
`iterate`) as one tokenized pair: the query's tokens, then the document's, token types 0 and
1, cut longest-first at the max length, as `tokenizer(query, document)` gives them."""

from __future__ import annotations

import pytest

from compress.data.datasets import Examples, collate, iterate

QUERIES = ["a gripping film", "dull", "the best performance of the year"]
DOCUMENTS = ["a gripping, beautiful film about two brothers", "a dull, lifeless movie", "hi"]


@pytest.fixture(scope="module")
def tokenizer():
    from conftest import minilm_folder
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_folder())


def test_a_batch_of_pairs_is_what_the_tokenizer_gives_each_pair(tokenizer) -> None:
    examples = Examples(labels=[1, 0, 1], texts=QUERIES, pairs=DOCUMENTS)
    inputs, labels = collate(examples, [2, 0], tokenizer, 12)
    assert labels.tolist() == [1, 1]
    for row, i in enumerate((2, 0)):
        alone = tokenizer(QUERIES[i], DOCUMENTS[i], truncation=True, max_length=12)
        length = len(alone["input_ids"])
        assert inputs["input_ids"][row, :length].tolist() == alone["input_ids"]
        assert inputs["token_type_ids"][row, :length].tolist() == alone["token_type_ids"]
        assert int(inputs["attention_mask"][row].sum()) == length
    # the second text's tokens are type 1: the pair was not read as one text
    assert int(inputs["token_type_ids"][1].sum()) > 0
    assert inputs["input_ids"].shape[1] <= 12  # cut at max_length, longest first


def test_head_subset_and_iterate_keep_the_pairs(tokenizer) -> None:
    examples = Examples(labels=[], texts=QUERIES, pairs=DOCUMENTS)
    assert examples.head(2).pairs == DOCUMENTS[:2]
    picked = examples.subset([2, 0])
    assert (picked.texts, picked.pairs, picked.labels) == ([QUERIES[2], QUERIES[0]],
                                                            [DOCUMENTS[2], DOCUMENTS[0]], [])
    batches = [inputs for inputs, _ in iterate(examples, 2, tokenizer, 32)]
    assert [b["input_ids"].shape[0] for b in batches] == [2, 1]
    single = Examples(labels=[], texts=QUERIES)  # no pairs: one text each, all type 0
    plain, _ = collate(single, [0, 1, 2], tokenizer, 32)
    assert int(plain["token_type_ids"].sum()) == 0
    paired, _ = collate(examples, [0, 1, 2], tokenizer, 32)
    assert paired["input_ids"].shape[1] > plain["input_ids"].shape[1]  # both texts read

"""Issue 75 item 4 (MTEB for embeddings), in-process: the local tasks read the SST-2 mirror as
they say (the classification splits, known-item queries whose one relevant document is the
sentence they came from); MTEB through `MtebEncoder` scores an embedder by them (a
bag-of-words embedder finds nearly every sentence from four of its words, one that knows no
words scores chance), asking for queries and documents as OpenAI's input_type; the export
folder's embedder reads a prompted model's texts as its served handler does; `evaluation.mteb`
is an embedding recipe's option only, a bad task name one clear line, and the report shows
each task's score."""

from __future__ import annotations

import hashlib
import re

import pytest
import torch

pytest.importorskip("mteb")

from compress.errors import UserError  # noqa: E402
from compress.families.embedding import evaluation_harness as harness  # noqa: E402
from compress.families.embedding.local_tasks import (  # noqa: E402
    SAMPLES_PER_LABEL,
    TRAIN_POOL,
    SST2KnownItemRetrieval,
    SST2LocalClassification,
)
from compress.recipe.family_specs import family_problems  # noqa: E402
from compress.recipe.schema import load_recipe  # noqa: E402

WIDTH = 512
WORD = re.compile(r"\w+")


class BagOfWords:
    """Each text as the counts of its hashed words (a query's four words lie in its
    sentence), recording the input types asked for."""

    name = "bag_of_words"

    def __init__(self, blind: bool = False) -> None:
        self.blind, self.asked = blind, []

    def embed(self, texts: list[str], input_type: str | None) -> torch.Tensor:
        self.asked.append((input_type, len(texts)))
        out = torch.zeros(len(texts), WIDTH)
        for row, text in enumerate(texts):
            if self.blind:  # every text alike: nothing to retrieve or classify by
                out[row, 0] = 1.0
                continue
            for word in WORD.findall(text.lower()):
                out[row, int(hashlib.md5(word.encode()).hexdigest(), 16) % WIDTH] += 1.0
        return out


def test_the_local_tasks_read_the_mirror_as_they_say(data_dir, monkeypatch) -> None:
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    classification = SST2LocalClassification()
    classification.limit = 40
    classification.load_data()
    splits = classification.dataset
    assert len(splits["train"]) == TRAIN_POOL and len(splits["validation"]) == 40
    assert set(splits["validation"]["label"]) == {0, 1}
    assert classification.samples_per_label == SAMPLES_PER_LABEL

    retrieval = SST2KnownItemRetrieval()
    retrieval.load_data()
    split = retrieval.dataset["default"]["validation"]
    corpus = dict(zip(split["corpus"]["id"], split["corpus"]["text"], strict=True))
    queries = dict(zip(split["queries"]["id"], split["queries"]["text"], strict=True))
    assert len(corpus) == 872 and 700 < len(queries) < 872  # short sentences give none
    assert set(split["relevant_docs"]) == set(queries)
    for query_id, relevant in split["relevant_docs"].items():
        (doc_id, grade), = relevant.items()
        assert grade == 1 and f" {queries[query_id]} " in f" {corpus[doc_id]} "


def test_mteb_scores_an_embedder_by_the_local_tasks(data_dir, monkeypatch) -> None:
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    tasks = ["SST2LocalClassification", "SST2KnownItemRetrieval"]
    words = BagOfWords()
    scores = harness.task_scores(words, tasks, limit=200, progress=False)
    assert set(scores) == {"mteb_SST2LocalClassification_accuracy",
                           "mteb_SST2KnownItemRetrieval_ndcg_at_10"}
    assert scores["mteb_SST2KnownItemRetrieval_ndcg_at_10"] > 0.85
    assert 0.5 < scores["mteb_SST2LocalClassification_accuracy"] < 0.8
    asked = {kind for kind, _ in words.asked}
    assert {"query", "document"} <= asked  # retrieval's two sides, as OpenAI's input_type
    assert all(count <= harness.REQUEST_TEXTS for _, count in words.asked)

    blind = harness.task_scores(BagOfWords(blind=True), tasks, limit=200, progress=False)
    assert blind["mteb_SST2KnownItemRetrieval_ndcg_at_10"] < 0.1
    assert blind["mteb_SST2LocalClassification_accuracy"] < 0.6  # a label's share at most


def test_an_unknown_task_is_named_with_the_local_ones() -> None:
    with pytest.raises(ValueError, match="'Nope' not found.*SST2LocalClassification"):
        harness.tasks_named(["Nope"])


def test_a_folder_that_is_no_embedding_export_is_one_line(tmp_path) -> None:
    with pytest.raises(ValueError, match="not an export folder"):
        harness.ExportEmbedder(tmp_path)
    (tmp_path / "export.json").write_text('{"format": "onnx", "file": "model.onnx"}')
    with pytest.raises(ValueError, match="not an embedding export"):
        harness.ExportEmbedder(tmp_path)


def test_the_module_embedder_reads_texts_as_the_server_does(cls_bert_folder) -> None:
    from compress.families.embedding.folder import load_recipe_encoder

    bundle = load_recipe_encoder(str(cls_bert_folder))
    facts = {"prompts": {"query": "query: ", "passage": "passage: "},
             "default_prompt_name": "passage", "truncate_dim": 16}
    embedder = harness.ModuleEmbedder(bundle, facts, 64)
    plain = harness.ModuleEmbedder(bundle, {}, 64)
    texts = ["a gripping film", "dull", "one of the year's best performances " * 9]
    cut = plain.embed(["query: " + t for t in texts], None)[:, :16]
    assert torch.allclose(embedder.embed(texts, "query"), cut, atol=1e-5)  # its prompt, cut
    passage = plain.embed(["passage: " + t for t in texts], None)[:, :16]
    for kind in (None, "document"):  # the default prompt; a document's prompt: passage
        assert torch.allclose(embedder.embed(texts, kind), passage, atol=1e-5)
    whole = plain.embed(texts, None)
    assert whole.shape == (3, 32)
    alone = torch.cat([plain.embed([t], None) for t in texts])  # passes of similar length
    assert torch.allclose(whole, alone, atol=1e-5)  # change nothing but the padding


def recipe_with(tmp_path, task: str, evaluation: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"name: r\nmodel: {{source: {tmp_path}, task: {task}}}\n"
                    f"data: {{source: {tmp_path}, text_column: sentence}}\n"
                    f"evaluation: {evaluation}\n")
    return str(path)


def test_evaluation_mteb_is_an_embedding_recipes_option(tmp_path) -> None:
    recipe = load_recipe(recipe_with(tmp_path, "embedding",
                                     "{mteb: {tasks: [SST2KnownItemRetrieval], limit: 50}}"))
    assert recipe.evaluation.mteb.tasks == ["SST2KnownItemRetrieval"]
    assert recipe.evaluation.mteb.limit == 50
    default = load_recipe(recipe_with(tmp_path, "embedding", "{mteb: {}}"))
    assert default.evaluation.mteb.tasks == ["SST2LocalClassification",
                                             "SST2KnownItemRetrieval"]
    plain = load_recipe(recipe_with(tmp_path, "embedding", "{batch_size: 8}"))
    assert "mteb" not in plain.evaluation.model_dump()  # cache keys of older recipes kept
    classifier = load_recipe(recipe_with(tmp_path, "classification", "{mteb: {}}"))
    assert ("evaluation.mteb: only an embedding model takes this option, and this model is "
            "a classifier (model.task: classification); remove it"
            in family_problems(classifier, "classification"))  # checked with the sources
    with pytest.raises(UserError, match="evaluation.mteb.limit"):
        load_recipe(recipe_with(tmp_path, "embedding", "{mteb: {limit: 0}}"))


def test_the_report_shows_each_tasks_score() -> None:
    from compress.report.build import derive_embedding
    from compress.report.render import columns

    row = {"metrics": {"fidelity": 0.99, "mteb_SST2KnownItemRetrieval_ndcg_at_10": 0.8123,
                       "mteb_SST2LocalClassification_accuracy": 0.71}}
    derive_embedding(row)
    assert row["mteb_SST2KnownItemRetrieval_ndcg_at_10"] == 0.8123
    cols = columns({"task": "embedding", "rows": [row], "batch_sizes": []})
    headers = {key: header for key, header, _, better in cols if key.startswith("mteb_")}
    assert headers == {"mteb_SST2KnownItemRetrieval_ndcg_at_10":
                       "SST2KnownItemRetrieval_ndcg_at_10",
                       "mteb_SST2LocalClassification_accuracy":
                       "SST2LocalClassification_accuracy"}

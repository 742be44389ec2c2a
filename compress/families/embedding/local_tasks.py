"""MTEB tasks over the data these machines have (the SST-2 mirror that `COMPRESS_DATA_DIR`
points at), so that an embedding model gets MTEB scores with no network:

- `SST2LocalClassification`: MTEB's classification protocol (a logistic regression trained
  on `SAMPLES_PER_LABEL` embedded training sentences of each label, drawn `EXPERIMENTS`
  times from a seeded pool of `TRAIN_POOL` train sentences; accuracy on the validation
  sentences, averaged over the draws).
- `SST2KnownItemRetrieval`: each validation sentence's known-item query
  (`compress.data.known_items`: a few words from its middle) against every validation
  sentence, its own sentence the one relevant document; nDCG@10.

`limit` keeps the first N validation sentences (both tasks' test side; the retrieval
corpus too), for a quick run. Any task of MTEB's own can be named beside these where its
dataset can be reached (`mteb.get_task`).
"""

from __future__ import annotations

from typing import Any

from datasets import Dataset, DatasetDict
from mteb.abstasks.classification import AbsTaskClassification
from mteb.abstasks.retrieval import AbsTaskRetrieval
from mteb.abstasks.retrieval_dataset_loaders import RetrievalSplitData
from mteb.abstasks.task_metadata import TaskMetadata

from compress.data.datasets import read_hub_split, read_table, seeded_subset
from compress.data.known_items import known_item_queries
from compress.recipe.datasets import resolve_data, split_file

SST2 = "stanfordnlp/sst2"
TRAIN_POOL = 2000  # train sentences the classifier's draws come from
SAMPLES_PER_LABEL = 32  # training sentences of each label in one draw
EXPERIMENTS = 10  # draws (MTEB's default)
SEED = 42

_COMMON: dict[str, Any] = {
    "dataset": {"path": SST2, "revision": "local-mirror"},
    "reference": "https://nlp.stanford.edu/sentiment/",
    "category": "t2t",
    "modalities": ["text"],
    "eval_splits": ["validation"],
    "eval_langs": ["eng-Latn"],
    "date": ("2013-01-01", "2013-12-31"),
    "domains": ["Reviews", "Written"],
    "license": "not specified",
    "annotations_creators": "human-annotated",
    "dialect": [],
    "sample_creation": "found",
    "bibtex_citation": "",
}


def sst2_split(split: str) -> list[dict[str, Any]]:
    """One split of SST-2 (rows with `sentence` and `label`): from the mirror that
    `COMPRESS_DATA_DIR` points at, else the hub where it can be reached (UserError: neither)."""
    source = resolve_data(SST2)
    if source.kind == "hub":
        return read_hub_split(SST2, split)
    return read_table(split_file(source.location, split))


class LimitedTask:
    """A local task that may be shrunk to the first `limit` validation sentences; each one
    says its dataset (`splits`)."""

    limit: int | None = None

    def validation(self) -> list[dict[str, Any]]:
        rows = sst2_split("validation")
        return rows[:self.limit] if self.limit else rows

    def load_data(self, num_proc: int | None = None, **kwargs: Any) -> None:
        """MTEB's hook: the task's dataset, in MTEB's layout for its type (each task's
        `splits`), read once."""
        if not self.data_loaded:
            self.dataset = self.splits()  # type: ignore[attr-defined]
            self.data_loaded = True


class SST2LocalClassification(LimitedTask, AbsTaskClassification):
    metadata = TaskMetadata(
        name="SST2LocalClassification",
        description="SST-2 sentiment (negative, positive) read from the local mirror: "
        "MTEB's classification protocol on the validation sentences.",
        type="Classification", main_score="accuracy", task_subtypes=["Sentiment/Hate speech"],
        **_COMMON)
    samples_per_label = SAMPLES_PER_LABEL
    n_experiments = EXPERIMENTS

    def splits(self) -> DatasetDict:
        pool = seeded_subset(sst2_split("train"), TRAIN_POOL, SEED)
        return DatasetDict({"train": table(pool), "validation": table(self.validation())})


class SST2KnownItemRetrieval(LimitedTask, AbsTaskRetrieval):
    metadata = TaskMetadata(
        name="SST2KnownItemRetrieval",
        description="Known-item retrieval over SST-2's validation sentences: a few words "
        "from the middle of a sentence find that sentence among all of them.",
        type="Retrieval", main_score="ndcg_at_10", task_subtypes=["Article retrieval"],
        **_COMMON)

    def splits(self) -> dict[str, dict[str, RetrievalSplitData]]:
        sentences = [str(row["sentence"]) for row in self.validation()]
        queries = known_item_queries(sentences)
        split = RetrievalSplitData(
            corpus=Dataset.from_dict({"id": [f"s{i}" for i in range(len(sentences))],
                                      "title": [""] * len(sentences), "text": sentences}),
            queries=Dataset.from_dict({"id": [f"q{i}" for _, i in queries],
                                       "text": [query for query, _ in queries]}),
            relevant_docs={f"q{i}": {f"s{i}": 1} for _, i in queries},
            top_ranked=None)
        return {"default": {"validation": split}}


def table(rows: list[dict[str, Any]]) -> Dataset:
    """SST-2 rows as MTEB's classification columns (`text`, `label`)."""
    return Dataset.from_dict({"text": [str(r["sentence"]) for r in rows],
                              "label": [int(r["label"]) for r in rows]})


LOCAL_TASKS = {task.metadata.name: task for task in (SST2LocalClassification,
                                                     SST2KnownItemRetrieval)}

"""A reranker's data: (query, document, relevance) pairs, grouped by query.

- A pair table (`data.pair_column` set): a local TSV, CSV or JSONL file (or a hub split)
  whose rows are pairs: the query in `data.text_column`, the document in
  `data.pair_column`, the relevance (an integer grade, 0: not relevant) in
  `data.label_column`. Rows with the same query text are one query's documents. A split's
  `max_samples` counts queries (a seeded subset of them, each with all its documents).
- Otherwise a known-item set built from the split's sentences (`data.text_column`), for
  when no retrieval set is at hand (these machines have only SST-2): each sentence's
  known-item query (`compress.data.known_items`: a few words from its middle), whose
  documents are the sentence itself (relevant, label 1) and the `DISTRACTORS` other
  sentences sharing the most distinct words with it (label 0; ties:
  the earlier sentence). `max_samples` counts sentences. Deterministic for a seed.

Either way each split is an `Examples` of pairs: `texts` the queries, `pairs` the documents,
`labels` the relevance, a query's pairs next to each other.
"""

from __future__ import annotations

import heapq
import re
from typing import Any

from compress.data.datasets import (
    DataBundle,
    Examples,
    read_hub_split,
    read_table,
    seeded_subset,
)
from compress.data.known_items import MIN_WORDS, known_item_queries
from compress.errors import UserError
from compress.recipe.chain import used_splits
from compress.recipe.datasets import DataSource, split_file

DISTRACTORS = 4
WORD = re.compile(r"\w+")


def load_pairs(recipe, source: DataSource) -> DataBundle:
    """Every split the recipe uses, as pairs (a pair table, else known-item pairs)."""
    cfg = recipe.data
    splits = {}
    for name in used_splits(recipe):
        split = getattr(cfg, name)
        if source.kind == "files":
            rows = read_table(split_file(source.location, split.split))
        else:
            rows = read_hub_split(source.location, split.split)
        if not rows:
            raise UserError(f"data.{name}: split '{split.split}' is empty")
        columns = [cfg.text_column] + ([cfg.pair_column, cfg.label_column]
                                       if cfg.pair_column else [])
        for option, column in zip(("text_column", "pair_column", "label_column"), columns,
                                  strict=False):
            if column not in rows[0]:
                raise UserError(f"data.{option}: column '{column}' not found (columns: "
                                f"{', '.join(rows[0])})")
        if cfg.pair_column:
            splits[name] = table_pairs(rows, cfg.text_column, cfg.pair_column,
                                       cfg.label_column, split.max_samples, recipe.seed)
        else:
            sentences = seeded_subset([str(r[cfg.text_column]) for r in rows],
                                      split.max_samples, recipe.seed)
            splits[name] = known_item_pairs(sentences)
        if not len(splits[name]):
            raise UserError(f"data.{name}: no pairs in split '{split.split}'"
                            + ("" if cfg.pair_column else
                               f" (no sentence of {MIN_WORDS} words or more to make a "
                               "known-item query of)"))
    return DataBundle("text", splits, ["score"], None, cfg.max_length)


def table_pairs(rows: list[dict[str, Any]], query: str, document: str, label: str,
                max_queries: int | None, seed: int) -> Examples:
    """A pair table's rows, grouped by query (queries in order of first appearance)."""
    grouped: dict[str, list[tuple[str, int]]] = {}
    for row in rows:
        try:
            grade = int(float(row[label]))
        except (TypeError, ValueError):
            raise UserError(f"data.label_column: relevance {row[label]!r} of query "
                            f"{str(row[query])[:40]!r} is not a number") from None
        grouped.setdefault(str(row[query]), []).append((str(row[document]), grade))
    queries = seeded_subset(list(grouped), max_queries, seed)
    out = Examples(labels=[], texts=[], pairs=[])
    for text in queries:
        for doc, grade in grouped[text]:
            out.texts.append(text)
            out.pairs.append(doc)
            out.labels.append(grade)
    return out


def known_item_pairs(sentences: list[str]) -> Examples:
    """Known-item pairs of `sentences` (the module's docstring says how)."""
    words = [set(WORD.findall(s.lower())) for s in sentences]
    out = Examples(labels=[], texts=[], pairs=[])
    for query, i in known_item_queries(sentences):
        sentence = sentences[i]
        overlap = heapq.nsmallest(DISTRACTORS, (j for j in range(len(sentences))
                                                if sentences[j] != sentence),
                                  key=lambda j: (-len(words[i] & words[j]), j))
        for j, label in [(i, 1)] + [(j, 0) for j in overlap]:
            out.texts.append(query)
            out.pairs.append(sentences[j])
            out.labels.append(label)
    return out


def groups_of(examples: Examples) -> list[int]:
    """Each pair's query id (pairs with the same query text share one)."""
    ids: dict[str, int] = {}
    return [ids.setdefault(text, len(ids)) for text in examples.texts or []]

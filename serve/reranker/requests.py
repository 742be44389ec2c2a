"""Requests to a served reranker, read into token rows of (query, document) pairs (shipped in
the reranker archive's `reranker` package; no compress imports).

The native route takes `{"query": s, "documents": [...]}` and answers each document's score
in order. `v1/rerank` (also at `rerank`: llama-server's, infinity's and text-embeddings-
inference's paths) takes Cohere's and Jina's body: `query`, `documents` (strings, or
`{"text": s}` objects), `top_n` (the best n, default all), `return_documents` (default false,
as Cohere and infinity) and `model` (any name); `null` is absent. Each pair is tokenized as
sentence-transformers' CrossEncoder tokenizes it, `tokenizer(query, document)`, cut
longest-first at the export's `max_seq_length` tokens. A field that is missing, of the wrong
type or past a limit (documents in one request, characters of a text) is a ValueError
naming the field: a 400 for that request alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve.batching import Row, complete_row
from serve.http_answers import check_unicode

FIELDS = ("model", "query", "documents", "top_n", "return_documents")
NATIVE_FIELDS = ("query", "documents")


@dataclass(frozen=True)
class Limits:
    """What a request may send, and the export's longest pair."""

    max_documents: int  # documents in one request: each is a row of the batch
    max_chars: int  # characters of the query or of one document
    max_tokens: int  # the export's max_seq_length: longer pairs are cut longest-first


@dataclass(frozen=True)
class RerankRequest:
    """One request read: a token row per document, and how its answer is written."""

    rows: list[Row]
    documents: list[str]
    rerank: bool = False  # v1/rerank's answer (else the native one)
    top_n: int | None = None  # the best n answered (None: all)
    return_documents: bool = False

    @property
    def tokens(self) -> int:
        """The tokens the model reads for this request (special tokens included)."""
        return sum(len(row[0]) for row in self.rows)


class Reader:
    """Reads request bodies into `RerankRequest`s with the export's tokenizer."""

    def __init__(self, tokenizer: Any, names: list[str], limits: Limits):
        self.tokenizer, self.names, self.limits = tokenizer, names, limits

    def native(self, body: Any) -> RerankRequest:
        """`{"query": s, "documents": [...]}`: every document's score, in order."""
        query, documents = self.pair_fields(body, NATIVE_FIELDS)
        return RerankRequest(self.pair_rows(query, documents), documents)

    def rerank(self, body: Any) -> RerankRequest:
        """A Cohere / Jina `rerank` body."""
        query, documents = self.pair_fields(body, FIELDS)
        body = {k: v for k, v in body.items() if v is not None}
        if "model" in body and not isinstance(body["model"], str):
            raise ValueError("model: a string")
        top_n = body.get("top_n")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int)
                                  or top_n < 1):
            raise ValueError(f"top_n: a positive integer, got {top_n!r}")
        back = body.get("return_documents", False)
        if not isinstance(back, bool):
            raise ValueError(f"return_documents: true or false, got {back!r}")
        return RerankRequest(self.pair_rows(query, documents), documents, rerank=True,
                             top_n=top_n, return_documents=back)

    def pair_fields(self, body: Any, fields: tuple[str, ...]) -> tuple[str, list[str]]:
        """The query and the documents' texts of a body, checked against the limits."""
        if not isinstance(body, dict):
            raise ValueError('send a JSON object: {"query": "...", "documents": ["...", ...]}')
        body = {k: v for k, v in body.items() if v is not None}
        unknown = sorted(set(body) - set(fields))
        if unknown:
            raise ValueError(f"unsupported field {unknown[0]!r}: this route takes "
                             f"{', '.join(fields)}")
        query = body.get("query")
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query: a non-empty string is required")
        documents = body.get("documents")
        if not isinstance(documents, list) or not documents:
            raise ValueError('documents: a non-empty list of strings or {"text": ...} '
                             "objects is required")
        limits = self.limits
        if len(documents) > limits.max_documents:
            raise ValueError(f"documents: {len(documents)}, at most {limits.max_documents} "
                             "in one request")
        texts = [document_text(d, k) for k, d in enumerate(documents)]
        for name, text in [("query", query)] + [(f"documents[{k}]", t)
                                                for k, t in enumerate(texts)]:
            if len(text) > limits.max_chars:
                raise ValueError(f"{name}: {len(text)} characters, at most "
                                 f"{limits.max_chars}")
            check_unicode(text)
        return query, texts

    def pair_rows(self, query: str, documents: list[str]) -> list[Row]:
        """Each (query, document) pair's token row, as `tokenizer(query, document)` gives
        it, cut longest-first at max_seq_length tokens."""
        encoded = self.tokenizer([query] * len(documents), documents, truncation=True,
                                 max_length=self.limits.max_tokens)
        return [complete_row({name: encoded[name][r] for name in self.names
                              if name in encoded}, self.names)
                for r in range(len(documents))]


def document_text(document: Any, index: int) -> str:
    """One document's text: a string, or an object's `text`."""
    if isinstance(document, dict):
        document = document.get("text")
    if not isinstance(document, str) or not document.strip():
        raise ValueError(f'documents[{index}]: a non-empty string or {{"text": "..."}}')
    return document

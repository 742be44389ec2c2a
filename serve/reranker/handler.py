"""compress's TorchServe handler for rerankers (cross-encoders): every (query, document) pair
of every good request in a TorchServe batch is a row, and the rows run in forward passes of
similar length (`batching.by_length`; one pass with `length_buckets: false`).

Packed into a reranker `.mar` by the package stage as `serve/reranker/`, with serve's own
modules beside it; imports nothing from compress. The exported file (`export.json` names it;
its `reranker` block says the activation, already applied inside the graph, and
max_seq_length) returns each pair's final score, what sentence-transformers'
`CrossEncoder.predict` gives. `model-config.yaml`'s `handler:` section (`HandlerSettings`)
holds threads, max_items (documents in one request), max_text_chars (characters of the
query or of a document) and length_buckets.

Routes: POST on the model's URL (`{"query", "documents"}`: `{"scores": [...]}`, one a
document, in order) and under it `v1/rerank` (and `rerank`), answered in the shape Cohere,
Jina, llama-server and infinity use: `{"model", "results": [{"index", "relevance_score",
"document": {"text"}}], "usage": {"prompt_tokens", "total_tokens"}}`, best first, the
`top_n` best where asked, `document` only with `return_documents: true`; and `v1/models`.
`requests.py` reads the bodies.

Each request is read and tokenized alone, so whatever its body holds is a 400 for it only
(naming the field); a score that is not finite is a 422; a batch whose forward pass fails is
run again one request at a time, and only a request that fails alone gets a 500. Every
answer carries `X-Batch-Size`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from serve.batching import MODELS
from serve.exported_encoder import ExportedEncoderHandler

from . import requests as rerank_requests

logger = logging.getLogger(__name__)
RERANK = "v1/rerank"


class RerankerHandler(ExportedEncoderHandler):
    """Loads an exported cross-encoder and answers each TorchServe batch's pairs in passes of
    similar length."""

    facts_key = "reranker"
    routes = {RERANK: RERANK, "rerank": RERANK, MODELS: MODELS}  # llama-server's alias

    def make_reader(self) -> rerank_requests.Reader:
        limits = rerank_requests.Limits(self.settings.max_items, self.settings.max_text_chars,
                                        self.max_tokens)
        logger.info("compress reranker handler: %s %s, %d threads, %s activation, "
                    "max_seq_length %d", self.meta["format"], self.meta["file"],
                    self.threads, self.facts.get("activation"), limits.max_tokens)
        return rerank_requests.Reader(self.tokenizer, self.meta["inputs"], limits)

    def read(self, body: Any, route: str | None) -> rerank_requests.RerankRequest:
        """One request's body read into pair rows (ValueError: a 400 that says why)."""
        return self.reader.native(body) if route is None else self.reader.rerank(body)

    def answer(self, one: rerank_requests.RerankRequest,
               outputs: list[Any] | Exception) -> Any:
        """The answer to one request from its pairs' scores, or its error."""
        if isinstance(outputs, Exception):
            return (500, "scoring failed")
        scores = [float(s.reshape(-1)[0]) for s in outputs]
        if not all(math.isfinite(s) for s in scores):
            return (422, "the model's score of a pair is not a finite number (NaN or "
                         "infinity)")
        if not one.rerank:
            return {"scores": scores}
        return rerank_answer(scores, one, self.model_name)



def rerank_answer(scores: list[float], one: rerank_requests.RerankRequest,
                  model: str) -> dict[str, Any]:
    """Cohere's and Jina's answer: the documents best first (the `top_n` best where
    asked; ties in the order sent), each with its index and score (and text)."""
    order = sorted(range(len(scores)), key=lambda k: (-scores[k], k))[:one.top_n]
    results = []
    for k in order:
        result: dict[str, Any] = {"index": k, "relevance_score": scores[k]}
        if one.return_documents:
            result["document"] = {"text": one.documents[k]}
        results.append(result)
    return {"model": model, "results": results,
            "usage": {"prompt_tokens": one.tokens, "total_tokens": one.tokens}}

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

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from ts.torch_handler.base_handler import BaseHandler

from serve.batching import MODELS, answer_batch, by_length, padded
from serve.handler_settings import HandlerSettings
from serve.runtimes import load_runtime
from serve.worker_threads import worker_threads

from . import requests as rerank_requests

logger = logging.getLogger(__name__)
PROGRESS = "compress worker: "  # what `compress serve` echoes while the worker starts
RERANK = "v1/rerank"
ROUTES = {RERANK: RERANK, "rerank": RERANK, MODELS: MODELS}


class RerankerHandler(BaseHandler):
    """Loads an exported cross-encoder and answers each TorchServe batch's pairs in passes of
    similar length."""

    def initialize(self, context) -> None:
        """Load the exported file with a fixed intra-op thread count, and the tokenizer."""
        from transformers import AutoTokenizer

        model_dir = Path(context.system_properties["model_dir"])
        config = context.model_yaml_config or {}
        settings = HandlerSettings.from_config(config.get("handler"))
        logger.info("%sloading %s", PROGRESS, model_dir.name)
        self.meta = json.loads((model_dir / "export.json").read_text())
        facts = self.meta.get("reranker") or {}
        threads = worker_threads(settings.threads, config.get("maxWorkers", 1))
        torch.set_num_threads(threads)
        self.forward = load_runtime(model_dir, self.meta, threads, spinning=False)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_name = context.model_name
        self.length_buckets = settings.length_buckets and not self.meta.get("aoti_packed")
        limits = rerank_requests.Limits(
            settings.max_items, settings.max_text_chars,
            int(facts.get("max_seq_length") or self.tokenizer.model_max_length))
        self.reader = rerank_requests.Reader(self.tokenizer, self.meta["inputs"], limits)
        self.initialized = True
        logger.info("compress reranker handler: %s %s, %d threads, %s activation, "
                    "max_seq_length %d", self.meta["format"], self.meta["file"], threads,
                    facts.get("activation"), limits.max_tokens)

    def handle(self, data: list[dict[str, Any]], context) -> list[str]:
        """Answer every request of the batch: forward passes over all good pairs."""
        return answer_batch(data, context, self.model_name, route_of, self.read,
                            self.score_rows, self.answer)

    def read(self, body: Any, route: str | None) -> rerank_requests.RerankRequest:
        """One request's body read into pair rows (ValueError: a 400 that says why)."""
        return self.reader.native(body) if route is None else self.reader.rerank(body)

    def score_rows(self, rows: list[list[list[int]]]) -> list[float]:
        """The scores of these pair rows, in passes of similar length unless the archive's
        `length_buckets` is false."""
        return by_length(rows, self.score, self.length_buckets)

    def score(self, rows: list[list[list[int]]]) -> list[float]:
        """The scores of these pair rows (right-padded), one float a row."""
        inputs = padded(rows, self.tokenizer.pad_token_id or 0, self.meta["inputs"])
        with torch.inference_mode():
            out = self.forward(*inputs)
        out = out[0] if isinstance(out, list | tuple) else out
        return out.float().reshape(-1).tolist()

    def answer(self, one: rerank_requests.RerankRequest,
               scores: list[float] | Exception) -> Any:
        """The answer to one request from its pairs' scores, or its error."""
        if isinstance(scores, Exception):
            return (500, "scoring failed")
        if not all(math.isfinite(s) for s in scores):
            return (422, "the model's score of a pair is not a finite number (NaN or "
                         "infinity)")
        if not one.rerank:
            return {"scores": scores}
        return rerank_answer(scores, one, self.model_name)


def route_of(url_path: str | None) -> str | None:
    """The route of a request's `url_path` header, None for the native route; LookupError
    (a 404) for another path."""
    path = (url_path or "").strip("/")
    if not path:
        return None
    if path not in ROUTES:
        raise LookupError(f"unknown path {path!r}: this model answers {', '.join(ROUTES)} "
                          "and POST on its own URL")
    return ROUTES[path]


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

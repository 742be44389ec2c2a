"""compress's TorchServe handler for embedding models: every input of every good request in a
TorchServe batch is a row, and the rows run in forward passes of similar length.

Packed into an embedding `.mar` by the package stage as `serve/embedding/`, with serve's own
modules beside it (`serve/`, what every handler shares); imports nothing from compress. The
exported file (`export.json` names it; its `embedding` block says the pooling, normalization,
width, max_seq_length and Matryoshka training, and where the model's folder set them its
prompts, default prompt and truncate_dim: `requests.py`) returns each row's embedding already pooled
and normalized. `model-config.yaml`'s `handler:` section (`HandlerSettings`) holds threads,
max_items (inputs in one request), max_text_chars and length_buckets (rows in passes of
similar length, `batching.by_length`; a packed file, which computes the real tokens only,
takes every row in one pass).

Routes: POST on the model's URL (text, texts or plain text: `{"embedding": [...]}`, or
`{"embeddings": [[...], ...]}` for texts) and under it OpenAI's `v1/embeddings` and
`v1/models`, so that the `openai` client reaches it with
`base_url=http://HOST:PORT/predictions/MODEL/VERSION/v1` and the inference token as its key
(`requests.py` reads the bodies). OpenAI's answer is `{"object": "list", "data":
[{"object": "embedding", "index", "embedding"}], "model", "usage": {"prompt_tokens",
"total_tokens"}}`, each embedding a list of floats or, with `encoding_format: base64`, the
base64 of its little-endian float32 bytes (what OpenAI's client asks for by default).

Each request is read and tokenized alone, so whatever its body holds is a 400 for it only
(OpenAI's error object on its routes); an embedding that is not finite is a 422; a batch
whose forward pass fails is run again one request at a time, and only a request that fails
alone gets a 500. Every answer carries `X-Batch-Size`: how many requests TorchServe served in
the same batch.
"""

from __future__ import annotations

import base64
import logging
from typing import Any

import torch

from serve.batching import MODELS
from serve.exported_encoder import ExportedEncoderHandler

from . import requests as embedding_requests

logger = logging.getLogger(__name__)
EMBEDDINGS = "v1/embeddings"


class EmbeddingHandler(ExportedEncoderHandler):
    """Loads an exported sentence encoder and answers each TorchServe batch in passes of
    similar length."""

    facts_key = "embedding"
    routes = {EMBEDDINGS: EMBEDDINGS, MODELS: MODELS}

    def make_reader(self) -> embedding_requests.Reader:
        facts = self.facts
        self.normalize = bool(facts.get("normalize"))
        limits = embedding_requests.Limits.of_export(
            facts, self.settings.max_items, self.settings.max_text_chars, self.max_tokens)
        logger.info("compress embedding handler: %s %s, %d threads, %d dimensions, %s "
                    "pooling, max_seq_length %d", self.meta["format"], self.meta["file"],
                    self.threads, limits.width, facts.get("pooling"), limits.max_tokens)
        return embedding_requests.Reader(self.tokenizer, self.meta["inputs"], limits)

    def read(self, body: Any, route: str | None) -> embedding_requests.EmbeddingRequest:
        """One request's body read into token rows (ValueError: a 400 that says why)."""
        return self.reader.native(body) if route is None else self.reader.openai(body)

    def answer(self, one: embedding_requests.EmbeddingRequest,
               vectors: list[torch.Tensor] | Exception) -> Any:
        """The answer to one request from its rows' embeddings, or its error."""
        if isinstance(vectors, Exception):
            return (500, "embedding failed")
        matrix = torch.stack(vectors)
        if not torch.isfinite(matrix).all():
            return (422, "the model's embedding of this input is not a finite number (NaN "
                         "or infinity)")
        matrix = embedding_requests.narrowed(matrix, one.dimensions, self.normalize)
        if not one.openai:
            return native_answer(matrix, one.many)
        return openai_answer(matrix, self.model_name, one.tokens, one.base64)



def as_base64(vector: torch.Tensor) -> str:
    """One embedding as OpenAI's base64: its float32 values' little-endian bytes."""
    data = vector.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
    return base64.b64encode(data).decode("ascii")


def openai_answer(vectors: torch.Tensor, model: str, tokens: int,
                  base64_format: bool) -> dict[str, Any]:
    """OpenAI's answer to one `v1/embeddings` request: one entry per input, in order."""
    data = [{"object": "embedding", "index": k,
             "embedding": as_base64(row) if base64_format else row.tolist()}
            for k, row in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def native_answer(vectors: torch.Tensor, many: bool) -> dict[str, Any]:
    """The native answer: `{"embedding": [...]}`, or `{"embeddings": [[...], ...]}` for a
    request that sent `texts`."""
    rows = vectors.tolist()
    return {"embeddings": rows} if many else {"embedding": rows[0]}

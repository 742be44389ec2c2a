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
import json
import logging
from pathlib import Path
from typing import Any

import torch
from ts.torch_handler.base_handler import BaseHandler

from serve.batching import MODELS, answer_batch, by_length, padded
from serve.handler_settings import HandlerSettings
from serve.runtimes import load_runtime
from serve.worker_threads import worker_threads

from . import requests as embedding_requests

logger = logging.getLogger(__name__)
PROGRESS = "compress worker: "  # what `compress serve` echoes while the worker starts
EMBEDDINGS = "v1/embeddings"
ROUTES = (EMBEDDINGS, MODELS)


class EmbeddingHandler(BaseHandler):
    """Loads an exported sentence encoder and answers each TorchServe batch in passes of
    similar length."""

    def initialize(self, context) -> None:
        """Load the exported file with a fixed intra-op thread count, and the tokenizer."""
        from transformers import AutoTokenizer

        model_dir = Path(context.system_properties["model_dir"])
        config = context.model_yaml_config or {}
        settings = HandlerSettings.from_config(config.get("handler"))
        logger.info("%sloading %s", PROGRESS, model_dir.name)
        self.meta = json.loads((model_dir / "export.json").read_text())
        facts = self.meta["embedding"]
        threads = worker_threads(settings.threads, config.get("maxWorkers", 1))
        torch.set_num_threads(threads)
        self.forward = load_runtime(model_dir, self.meta, threads, spinning=False)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.normalize = bool(facts.get("normalize"))
        self.model_name = context.model_name
        # a packed file (export.json's aoti_packed) computes no padding: a batch is one pass
        self.length_buckets = settings.length_buckets and not self.meta.get("aoti_packed")
        limits = embedding_requests.Limits(
            settings.max_items, settings.max_text_chars,
            int(facts.get("max_seq_length") or self.tokenizer.model_max_length),
            int(facts["dimensions"]), bool(facts.get("matryoshka")),
            dict(facts.get("prompts") or {}), facts.get("default_prompt_name"),
            facts.get("truncate_dim"))
        self.reader = embedding_requests.Reader(self.tokenizer, self.meta["inputs"], limits)
        self.initialized = True
        logger.info("compress embedding handler: %s %s, %d threads, %d dimensions, %s "
                    "pooling, max_seq_length %d", self.meta["format"], self.meta["file"],
                    threads, limits.width, facts.get("pooling"), limits.max_tokens)

    def handle(self, data: list[dict[str, Any]], context) -> list[str]:
        """Answer every request of the batch: forward passes over all good inputs."""
        return answer_batch(data, context, self.model_name, route_of, self.read,
                            self.embed_rows, self.answer)

    def read(self, body: Any, route: str | None) -> embedding_requests.EmbeddingRequest:
        """One request's body read into token rows (ValueError: a 400 that says why)."""
        return self.reader.native(body) if route is None else self.reader.openai(body)

    def embed_rows(self, rows: list[list[list[int]]]) -> list[torch.Tensor]:
        """The embeddings of these token rows, in passes of similar length unless the
        archive's `length_buckets` is false."""
        return by_length(rows, self.embed, self.length_buckets)

    def embed(self, rows: list[list[list[int]]]) -> list[torch.Tensor]:
        """The embeddings of these token rows (right-padded, as the export's pooling reads
        them), one float32 vector a row."""
        inputs = padded(rows, self.tokenizer.pad_token_id or 0, self.meta["inputs"])
        with torch.inference_mode():
            out = self.forward(*inputs)
        out = out[0] if isinstance(out, list | tuple) else out
        return list(out.float())

    def answer(self, one: embedding_requests.EmbeddingRequest,
               vectors: list[torch.Tensor] | Exception) -> Any:
        """The answer to one request from its rows' embeddings, or its error."""
        if isinstance(vectors, Exception):
            return (500, "embedding failed")
        matrix = torch.stack(vectors)
        if not torch.isfinite(matrix).all():
            return (422, "the model's embedding of this input is not a finite number (NaN "
                         "or infinity)")
        matrix = narrowed(matrix, one.dimensions, self.normalize)
        if not one.openai:
            return native_answer(matrix, one.many)
        return openai_answer(matrix, self.model_name, one.tokens, one.base64)


def route_of(url_path: str | None) -> str | None:
    """The OpenAI route of a request's `url_path` header, None for the native route;
    LookupError (a 404) for another path."""
    path = (url_path or "").strip("/")
    if not path:
        return None
    if path not in ROUTES:
        raise LookupError(f"unknown path {path!r}: this model answers {', '.join(ROUTES)} "
                          "and POST on its own URL")
    return path


def narrowed(vectors: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """The embeddings cut to their first `dimensions` values (None: whole), made unit length
    again where the model normalizes (sentence-transformers' truncate_dim, then Normalize)."""
    if dimensions is None:
        return vectors
    cut = vectors[:, :dimensions]
    return torch.nn.functional.normalize(cut, p=2, dim=-1) if normalize else cut


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

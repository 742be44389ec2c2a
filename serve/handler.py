"""compress's TorchServe handler: one batched forward pass per TorchServe batch.

Packed into every `.mar` by the package stage and loaded by TorchServe's workers, so it
imports no compress code: the archive holds the exported file, its `export.json`
(format, inputs, labels), the tokenizer files, `index_to_name.json` and
`model-config.yaml` (whose `handler:` section holds threads, max_length, max_text_chars
and max_items: texts or arrays in one request, 64 by default).

Requests: `{"text": "..."}`, `{"texts": ["...", ...]}`, a plain-text body, or for image
models `{"input": nested array}` / `{"inputs": [...]}` / a bare nested array. Each request
gets exactly one answer: `{"label", "score", "probabilities"}` (a list of them for
"texts"/"inputs"), or a 400 with a message for that request alone. Every answer carries
`X-Batch-Size`: how many requests TorchServe served in the same batch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from ts.torch_handler.base_handler import BaseHandler

try:  # inside the archive the modules lie beside this file
    from handler_metrics import record
    from http_answers import reason_phrase
    from runtimes import load_runtime
    from worker_threads import worker_threads
except ImportError:  # in the compress repository
    from serve.handler_metrics import record
    from serve.http_answers import reason_phrase
    from serve.runtimes import load_runtime
    from serve.worker_threads import worker_threads

logger = logging.getLogger(__name__)

BATCH_HEADER = "X-Batch-Size"
PROGRESS = "compress worker: "  # what `compress serve` echoes while the worker starts
# TorchServe wants exactly one class in a handler module: a request this handler cannot
# answer raises ValueError from `parse`, and its message goes back with a 400.
DEFAULT_MAX_CHARS = 10_000
DEFAULT_MAX_ITEMS = 64  # texts (or arrays) in one request: each is a row of the batch


class CompressHandler(BaseHandler):
    """Loads an exported model in its own runtime and answers requests in batches."""

    max_items = DEFAULT_MAX_ITEMS

    def initialize(self, context) -> None:
        """Load the exported file with a fixed intra-op thread count and the tokenizer."""
        model_dir = Path(context.system_properties["model_dir"])
        config = context.model_yaml_config or {}
        settings = config.get("handler") or {}
        logger.info("%sloading %s", PROGRESS, model_dir.name)
        self.meta = json.loads((model_dir / "export.json").read_text())
        self.threads = worker_threads(settings.get("threads"), config.get("maxWorkers", 1))
        torch.set_num_threads(self.threads)
        self.forward = load_runtime(model_dir, self.meta, self.threads, spinning=False)
        names = json.loads((model_dir / "index_to_name.json").read_text())
        self.labels = [names[str(i)] for i in range(len(names))]
        self.text = bool(self.meta["text"])
        self.max_length = int(settings.get("max_length", 128))
        self.max_chars = int(settings.get("max_text_chars", DEFAULT_MAX_CHARS))
        self.max_items = int(settings.get("max_items", DEFAULT_MAX_ITEMS))
        self.input_shape = self.meta.get("input_shape")
        self.tokenizer = None
        if self.text:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.initialized = True
        logger.info("compress handler: %s %s, %d threads, labels %s", self.meta["format"],
                    self.meta["file"], self.threads, self.labels)

    def handle(self, data: list[dict[str, Any]], context) -> list[Any]:
        """Answer every request of the batch: one forward pass over all good items."""
        items, owners, results = self.preprocess(data, context)
        if items:
            probabilities = torch.softmax(self.inference(self.collate(items)).float(), dim=-1)
            answers = self.postprocess(probabilities)
            for i, (owner, many) in enumerate(owners):
                if many:
                    results[owner].append(answers[i])
                else:
                    results[owner] = answers[i]
        for i in range(len(data)):
            context.set_response_header(i, BATCH_HEADER, str(len(data)))
            context.set_response_content_type(i, "application/json")
        record(context, "CompressBatchRows", len(data))
        return [json.dumps(r) for r in results]

    def preprocess(self, data: list[dict[str, Any]], context) -> tuple[list, list, list]:
        """Parse each request: (items of the forward pass, (request index, is a list) per
        item, the results list with the 400 answers already filled in)."""
        items: list[Any] = []
        owners: list[tuple[int, bool]] = []
        results: list[Any] = []
        for i, request in enumerate(data):
            try:
                parsed, many = self.parse(request, _content_type(context, i, request))
            except ValueError as exc:
                context.set_response_status(400, reason_phrase(str(exc)), idx=i)
                record(context, "CompressBadRequests", 1)
                results.append({"error": str(exc), "status": 400})
                continue
            results.append([] if many else None)
            items += parsed
            owners += [(i, many)] * len(parsed)
        return items, owners, results

    def parse(self, request: dict[str, Any], content_type: str) -> tuple[list[Any], bool]:
        """The items of one request and whether it asked for a list of answers."""
        body = request.get("body", request.get("data"))
        if body is None and "text" in request:  # a form field: curl -d text=...
            text = request["text"]
            body = {"text": bytes(text).decode("utf-8", "replace")
                    if isinstance(text, bytes | bytearray) else text}
        if body is None:
            raise ValueError('no request body: send {"text": "..."} as application/json, or '
                             "the text itself as text/plain")
        if isinstance(body, bytes | bytearray):
            try:
                body = body.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError("the body is not UTF-8 text") from None
        if isinstance(body, str) and ("json" in content_type or body.lstrip()[:1] in "{["):
            try:
                body = json.loads(body) if body.strip() else None
            except json.JSONDecodeError as exc:
                raise ValueError(f"malformed JSON: {exc}") from None
        return self.parse_text(body) if self.text else self.parse_array(body)

    def parse_text(self, body: Any) -> tuple[list[str], bool]:
        """`{"text": s}`, `{"texts": [s, ...]}` or a plain string."""
        many = isinstance(body, dict) and "texts" in body
        if isinstance(body, dict):
            texts = body.get("texts") if many else body.get("text")
        else:
            texts = body
        texts = texts if many else [texts]
        if not isinstance(texts, list) or not texts or not all(
                isinstance(t, str) and t.strip() for t in texts):
            raise ValueError('no text: send {"text": "..."}, {"texts": ["...", ...]} or a '
                             "plain-text body")
        if len(texts) > self.max_items:
            raise ValueError(f"too many texts: {len(texts)}, at most {self.max_items} in one "
                             f"request")
        longest = max(len(t) for t in texts)
        if longest > self.max_chars:
            raise ValueError(f"text too long: {longest} characters, at most {self.max_chars}")
        return texts, many

    def parse_array(self, body: Any) -> tuple[list[torch.Tensor], bool]:
        """`{"input": array}`, `{"inputs": [array, ...]}` or a bare nested array."""
        many = isinstance(body, dict) and "inputs" in body
        arrays = (body.get("inputs") if many else body.get("input")) if isinstance(
            body, dict) else body
        arrays = arrays if many else [arrays]
        if isinstance(arrays, list) and len(arrays) > self.max_items:
            raise ValueError(f"too many inputs: {len(arrays)}, at most {self.max_items} in one "
                             f"request")
        shape = list(self.input_shape or [])
        tensors = []
        for array in arrays if isinstance(arrays, list) and arrays else [None]:
            try:
                tensor = torch.tensor(array, dtype=torch.float32)
            except (TypeError, ValueError, RuntimeError):
                tensor = None
            if tensor is None or (shape and list(tensor.shape) != shape):
                raise ValueError(f'expected {{"input": a nested array of shape {shape}}} or '
                                 f'{{"inputs": [...]}}')
            tensors.append(tensor)
        return tensors, many

    def collate(self, items: list[Any]) -> tuple[torch.Tensor, ...]:
        """One batch: texts tokenized together, padded to the longest; arrays stacked."""
        if not self.text:
            return (torch.stack(items),)
        encoded = self.tokenizer(items, padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt")
        ids = encoded["input_ids"]
        defaults = {"attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
        return tuple(encoded.get(name, defaults.get(name)) for name in self.meta["inputs"])

    def inference(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One forward pass of the exported model."""
        with torch.inference_mode():
            out = self.forward(*inputs)
        return out[0] if isinstance(out, list | tuple) else out

    def postprocess(self, probabilities: torch.Tensor) -> list[dict[str, Any]]:
        """`{"label", "score", "probabilities"}` for each row."""
        answers = []
        for row in probabilities.tolist():
            best = max(range(len(row)), key=row.__getitem__)
            answers.append({"label": self.labels[best], "score": row[best],
                            "probabilities": dict(zip(self.labels, row, strict=True))})
        return answers


def _content_type(context, idx: int, request: dict[str, Any]) -> str:
    """The content type of the request's body parameter ("" when unknown)."""
    name = "body" if "body" in request else "data"
    try:
        header = context.get_request_header(idx, name)
    except (AttributeError, IndexError, KeyError):
        return ""
    return (header or {}).get("content-type", "") if isinstance(header, dict) else ""

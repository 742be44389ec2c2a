"""compress's TorchServe handler: batched forward passes per TorchServe batch.

Packed into a classifier's `.mar` by the package stage as `serve/classifier/` (with serve's
own modules, what every handler shares) and loaded by TorchServe's workers, so it imports no
compress code: the archive holds the exported file, its `export.json`
(format, inputs, labels), the tokenizer files, `index_to_name.json` and
`model-config.yaml` (whose `handler:` section holds threads, max_length, max_text_chars
max_items: texts or arrays in one request, 64 by default, and length_buckets: a batch's texts
run in passes of similar length, true by default).

Requests: `{"text": "..."}`, `{"texts": ["...", ...]}`, a plain-text body, or for image
models `{"input": nested array}` / `{"inputs": [...]}` / a bare nested array. Each request
gets exactly one answer, as strict JSON: `{"label", "score", "probabilities"}` (a list of
them for "texts"/"inputs"), or an error for that request alone. Each request is read and
tokenized alone before it joins the batch, so whatever one body holds (bad UTF-8, a lone
surrogate, JSON nested too deep, NaN) is a 400 for it only; a model answer that is not
finite is a 422; a batch whose forward pass fails is run again one request at a time, and
only a request that fails alone gets a 500. Every answer carries `X-Batch-Size`: how many
requests TorchServe served in the same batch.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import torch
from ts.torch_handler.base_handler import BaseHandler

from serve.batching import (
    BATCH_HEADER,
    answer_rows,
    by_length,
    padded,
    text_items,
    token_rows,
    write_answer,
)
from serve.handler_metrics import record
from serve.handler_settings import HandlerSettings
from serve.http_answers import read_body, refusal, request_content_type
from serve.runtimes import load_runtime
from serve.worker_threads import worker_threads

logger = logging.getLogger(__name__)

PROGRESS = "compress worker: "  # what `compress serve` echoes while the worker starts
# TorchServe wants exactly one class in a handler module: a request this handler cannot
# answer raises ValueError from `parse`, and its message goes back with a 400.


class CompressHandler(BaseHandler):
    """Loads an exported model in its own runtime and answers requests in batches."""

    max_items = HandlerSettings.max_items
    length_buckets = HandlerSettings.length_buckets  # passes of similar length (`by_length`)

    def initialize(self, context) -> None:
        """Load the exported file with a fixed intra-op thread count and the tokenizer."""
        model_dir = Path(context.system_properties["model_dir"])
        config = context.model_yaml_config or {}
        settings = HandlerSettings.from_config(config.get("handler"))
        logger.info("%sloading %s", PROGRESS, model_dir.name)
        self.meta = json.loads((model_dir / "export.json").read_text())
        self.threads = worker_threads(settings.threads, config.get("maxWorkers", 1))
        torch.set_num_threads(self.threads)
        self.forward = load_runtime(model_dir, self.meta, self.threads, spinning=False)
        names = json.loads((model_dir / "index_to_name.json").read_text())
        self.labels = [names[str(i)] for i in range(len(names))]
        self.text = bool(self.meta["text"])
        self.max_length = settings.max_length
        self.max_chars = settings.max_text_chars
        self.max_items = settings.max_items
        self.length_buckets = settings.length_buckets
        self.input_shape = self.meta.get("input_shape")
        self.tokenizer = None
        if self.text:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.initialized = True
        logger.info("compress handler: %s %s, %d threads, labels %s", self.meta["format"],
                    self.meta["file"], self.threads, self.labels)

    def handle(self, data: list[dict[str, Any]], context) -> list[str]:
        """Answer every request of the batch: forward passes over all good items (texts in
        passes of similar length)."""
        items, owners, results = self.preprocess(data, context)
        rows = self.answer_rows(items, owners)
        for owner, answers in rows.items():
            if isinstance(answers, Exception):
                results[owner] = (500, "prediction failed")
            elif not all(math.isfinite(p) for a in answers for p in a["probabilities"].values()):
                results[owner] = (422, "the model's answer to this input is not a finite number "
                                       "(NaN or infinity)")
            else:
                results[owner] = answers if results[owner] else answers[0]
        for i in range(len(data)):
            context.set_response_header(i, BATCH_HEADER, str(len(data)))
            context.set_response_content_type(i, "application/json")
        record(context, "CompressBatchRows", len(data))
        return [self.write(i, result, context) for i, result in enumerate(results)]

    def write(self, i: int, result: Any, context) -> str:
        """Answer `i` as strict JSON; an error `(status, message)` also sets its status."""
        return write_answer(context, i, result)

    def preprocess(self, data: list[dict[str, Any]], context) -> tuple[list, list, list]:
        """Read each request alone: (items of the forward pass, the request index of each
        item, per request whether it asked for a list or its `(status, message)` error)."""
        items: list[Any] = []
        owners: list[int] = []
        results: list[Any] = []
        for i, request in enumerate(data):
            try:
                parsed, many = self.parse(request, request_content_type(context, i,
                                                                        request))
                if self.text:
                    parsed = self.encode(parsed)
            except Exception as exc:  # noqa: BLE001 (whatever one request raises is its own)
                results.append((400, refusal(exc)))
                continue
            results.append(many)
            items += parsed
            owners += [i] * len(parsed)
        return items, owners, results

    def parse(self, request: dict[str, Any], content_type: str) -> tuple[list[Any], bool]:
        """The items of one request and whether it asked for a list of answers."""
        body = read_body(request, content_type)
        return self.parse_text(body) if self.text else self.parse_array(body)

    def parse_text(self, body: Any) -> tuple[list[str], bool]:
        """`{"text": s}`, `{"texts": [s, ...]}` or a plain string."""
        return text_items(body, self.max_items, self.max_chars)

    def parse_array(self, body: Any) -> tuple[list[torch.Tensor], bool]:
        """`{"input": array}`, `{"inputs": [array, ...]}` or a bare nested array of finite
        numbers."""
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
            except Exception:  # noqa: BLE001 (strings, None, ragged lists, ints past float)
                tensor = None
            if tensor is None or (shape and list(tensor.shape) != shape):
                raise ValueError(f'expected {{"input": a nested array of shape {shape}}} or '
                                 f'{{"inputs": [...]}}')
            if not torch.isfinite(tensor).all():
                raise ValueError("the input holds NaN or infinity (or a number past float32's "
                                 "range): send finite numbers")
            tensors.append(tensor)
        return tensors, many

    def encode(self, texts: list[str]) -> list[list[list[int]]]:
        """One request's texts tokenized alone, unpadded: per text, the token lists of the
        model's inputs (a mask of ones and token types of zeros where the tokenizer gives
        none)."""
        return token_rows(self.tokenizer, texts, self.max_length, self.meta["inputs"])

    def collate(self, items: list[Any]) -> tuple[torch.Tensor, ...]:
        """One batch: token rows padded to the longest (on the tokenizer's side); arrays
        stacked."""
        if not self.text:
            return (torch.stack(items),)
        return padded(items, self.tokenizer.pad_token_id or 0, self.meta["inputs"],
                      left=self.tokenizer.padding_side == "left")

    def answer_rows(self, items: list[Any], owners: list[int]) -> dict[int, Any]:
        """Each request's answers, one per item, from the batch's passes; where they fail,
        each request is run alone, so only one that fails alone gets its exception."""
        return answer_rows(items, owners, self.answer_items)

    def answer_items(self, items: list[Any]) -> list[dict[str, Any]]:
        """One answer per item: token rows in passes of similar length (unless the
        archive's `length_buckets` is false), arrays in one pass."""
        def run(part: list[Any]) -> list[dict[str, Any]]:
            return self.postprocess(self.probabilities(part))

        return by_length(items, run, self.text and self.length_buckets)

    def probabilities(self, items: list[Any]) -> torch.Tensor:
        """Softmax of the model's logits for these items, in float32."""
        return torch.softmax(self.inference(self.collate(items)).float(), dim=-1)

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


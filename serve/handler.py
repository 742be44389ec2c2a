"""compress's TorchServe handler: one batched forward pass per TorchServe batch.

Packed into every `.mar` by the package stage and loaded by TorchServe's workers, so it
imports no compress code: the archive holds the exported file, its `export.json`
(format, inputs, labels), the tokenizer files, `index_to_name.json` and
`model-config.yaml` (whose `handler:` section holds threads, max_length, max_text_chars
and max_items: texts or arrays in one request, 64 by default).

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

try:  # inside the archive the modules lie beside this file
    from handler_metrics import record
    from http_answers import check_unicode, json_answer, load_json, reason_phrase
    from runtimes import load_runtime
    from worker_threads import worker_threads
except ImportError:  # in the compress repository
    from serve.handler_metrics import record
    from serve.http_answers import check_unicode, json_answer, load_json, reason_phrase
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

    def handle(self, data: list[dict[str, Any]], context) -> list[str]:
        """Answer every request of the batch: one forward pass over all good items."""
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
        if not isinstance(result, tuple):
            try:
                return json_answer(result)
            except (TypeError, ValueError):
                logger.exception("request %d: its answer is not JSON", i)
                result = (500, "the answer could not be written as JSON")
        status, message = result
        context.set_response_status(status, reason_phrase(message), idx=i)
        record(context, "CompressBadRequests" if status < 500 else "CompressFailedRequests", 1)
        return json_answer({"error": message, "status": status})

    def preprocess(self, data: list[dict[str, Any]], context) -> tuple[list, list, list]:
        """Read each request alone: (items of the forward pass, the request index of each
        item, per request whether it asked for a list or its `(status, message)` error)."""
        items: list[Any] = []
        owners: list[int] = []
        results: list[Any] = []
        for i, request in enumerate(data):
            try:
                parsed, many = self.parse(request, _content_type(context, i, request))
                if self.text:
                    parsed = self.encode(parsed)
            except Exception as exc:  # noqa: BLE001 (whatever one request raises is its own)
                results.append((400, _refusal(exc)))
                continue
            results.append(many)
            items += parsed
            owners += [i] * len(parsed)
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
        raw = isinstance(body, bytes | bytearray)
        if raw:
            try:
                body = bytes(body).decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError("the body is not UTF-8 text") from None
        # TorchServe decodes a JSON body itself: a str it hands over with a JSON content
        # type is a JSON string, parsed again only where it looks like JSON (as a plain-text
        # body is); raw bytes are parsed where the content type says JSON
        if isinstance(body, str) and ((raw and "json" in content_type)
                                      or body.lstrip()[:1] in "{["):
            body = load_json(body)
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
        for text in texts:
            check_unicode(text)
        return texts, many

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
        encoded = self.tokenizer(texts, truncation=True, max_length=self.max_length)
        rows = []
        for r, ids in enumerate(encoded["input_ids"]):
            defaults = {"attention_mask": [1] * len(ids), "token_type_ids": [0] * len(ids)}
            rows.append([encoded[name][r] if name in encoded else defaults[name]
                         for name in self.meta["inputs"]])
        return rows

    def collate(self, items: list[Any]) -> tuple[torch.Tensor, ...]:
        """One batch: token rows padded to the longest (on the tokenizer's side); arrays
        stacked."""
        if not self.text:
            return (torch.stack(items),)
        longest = max(len(row[0]) for row in items)
        left = self.tokenizer.padding_side == "left"
        pads = [(self.tokenizer.pad_token_id or 0) if name == "input_ids" else 0
                for name in self.meta["inputs"]]
        columns = []
        for k, pad in enumerate(pads):
            padded = [([pad] * (longest - len(row[k])) if left else []) + row[k]
                      + ([] if left else [pad] * (longest - len(row[k]))) for row in items]
            columns.append(torch.tensor(padded, dtype=torch.long))
        return tuple(columns)

    def answer_rows(self, items: list[Any], owners: list[int]) -> dict[int, Any]:
        """Each request's answers, one per item, from one forward pass; where the batch
        fails, each request is run alone, so only one that fails alone gets its exception."""
        if not items:
            return {}
        try:
            return _grouped(self.postprocess(self.probabilities(items)), owners)
        except Exception:  # noqa: BLE001 (a failing row must not fail the others)
            logger.exception("a batch of %d rows failed: running each request alone",
                             len(items))
        rows: dict[int, Any] = {}
        for owner in dict.fromkeys(owners):
            mine = [item for item, o in zip(items, owners, strict=True) if o == owner]
            try:
                rows[owner] = self.postprocess(self.probabilities(mine))
            except Exception as exc:  # noqa: BLE001
                logger.exception("request %d failed alone", owner)
                rows[owner] = exc
        return rows

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


def _grouped(answers: list[Any], owners: list[int]) -> dict[int, list[Any]]:
    """Answers in rows order, grouped by the request that owns each row."""
    grouped: dict[int, list[Any]] = {}
    for owner, answer in zip(owners, answers, strict=True):
        grouped.setdefault(owner, []).append(answer)
    return grouped


def _refusal(exc: Exception) -> str:
    """The 400 message of one request's exception: a ValueError's own message, else its
    kind (the traceback goes to the log)."""
    if isinstance(exc, ValueError):
        return str(exc)
    logger.warning("a request could not be read", exc_info=exc)
    return f"the request could not be read ({type(exc).__name__})"


def _content_type(context, idx: int, request: dict[str, Any]) -> str:
    """The content type of the request's body parameter ("" when unknown)."""
    name = "body" if "body" in request else "data"
    try:
        header = context.get_request_header(idx, name)
    except (AttributeError, IndexError, KeyError):
        return ""
    return (header or {}).get("content-type", "") if isinstance(header, dict) else ""

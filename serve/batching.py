"""The pieces of a batching handler (shipped in every archive; no compress imports): a text
model's request checked against the archive's limits and read into token rows, a batch of
rows padded into the model's input tensors, a TorchServe batch's rows run in forward passes of
similar length and answered per request, and each answer written.

Where the pass over all good requests' items (texts, arrays) fails, each request is run
alone, so that only a request that fails alone gets its exception. An answer is strict JSON;
an error `(status, message)` sets that request's status alone, with compress's error body
or, on OpenAI's routes, OpenAI's error object."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy
import torch

from serve.handler_metrics import record
from serve.http_answers import (
    check_unicode,
    json_answer,
    openai_error,
    openai_models,
    read_body,
    reason_phrase,
    refusal,
    request_content_type,
)

logger = logging.getLogger(__name__)
BATCH_HEADER = "X-Batch-Size"  # every answer says how many requests shared its batch
MODELS = "v1/models"  # OpenAI's model list, answered by every archive
Refusal = tuple[int, str]  # (status, message): a request's error answer
NO_TEXT = 'no text: send {"text": "..."}, {"texts": ["...", ...]} or a plain-text body'
# one text's tokens: per input of the model (input_ids, attention_mask, token_type_ids), a list
Row = list[list[int]]
# a forward pass's fixed cost, in padded tokens of work (what `length_buckets` weighs a cut
# against): MiniLM's int8 search winner (AOTInductor, 2 Zen 4 cores) took ~1.2 ms a pass
# and ~45 us a token, 1 to 32 rows of 8 to 64 tokens
PASS_OVERHEAD_TOKENS = 32
MAX_PASS_ROWS = 64  # rows in one pass of `length_buckets`' split (bounds its search)


def text_items(body: Any, max_items: int, max_chars: int) -> tuple[list[str], bool]:
    """(the texts of `{"text": s}`, `{"texts": [s, ...]}` or a plain string, whether a list
    of answers was asked for). ValueError: a 400 that says why."""
    many = isinstance(body, dict) and "texts" in body
    texts = body
    if isinstance(body, dict):
        texts = body.get("texts") if many else body.get("text")
    texts = texts if many else [texts]
    if not isinstance(texts, list) or not texts or not all(
            isinstance(t, str) and t.strip() for t in texts):
        raise ValueError(NO_TEXT)
    check_texts(texts, max_items, max_chars)
    return texts, many


def check_texts(texts: list[str], max_items: int, max_chars: int, noun: str = "texts") -> None:
    """ValueError past the limits (items in one request, characters in one text) or for a
    text that is no Unicode."""
    if len(texts) > max_items:
        raise ValueError(f"too many {noun}: {len(texts)}, at most {max_items} in one request")
    longest = max(len(t) for t in texts)
    if longest > max_chars:
        raise ValueError(f"text too long: {longest} characters, at most {max_chars}")
    for text in texts:
        check_unicode(text)


def token_rows(tokenizer: Any, texts: list[str], max_length: int,
               names: list[str]) -> list[Row]:
    """Each text tokenized alone, unpadded, truncated at `max_length` tokens: per text, the
    token lists of the model's inputs `names` (a mask of ones and token types of zeros where
    the tokenizer gives none)."""
    if getattr(tokenizer, "is_fast", False):
        return [complete_row({"input_ids": e.ids, "attention_mask": e.attention_mask,
                              "token_type_ids": e.type_ids}, names)
                for e in rust_encodings(tokenizer, texts, max_length)]
    encoded = tokenizer(texts, truncation=True, max_length=max_length)
    return [complete_row({name: encoded[name][r] for name in names if name in encoded}, names)
            for r in range(len(texts))]


def rust_encodings(tokenizer: Any, texts: list[str], max_length: int) -> list[Any]:
    """What a fast tokenizer's `tokenizer(texts, truncation=True, max_length=...)` encodes,
    straight from its Rust tokenizer, set up as that call sets it (truncation longest-first
    on the tokenizer's side, no padding) and without the character offsets: a third less time
    a batch, as much again for the Python lists the call builds."""
    backend = tokenizer.backend_tokenizer
    truncation = {"max_length": max_length, "stride": 0, "strategy": "longest_first",
                  "direction": tokenizer.truncation_side}
    if backend.truncation != truncation:
        backend.enable_truncation(**truncation)
    if backend.padding is not None:
        backend.no_padding()
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # tokenizers >= 0.21
    return encode(texts, add_special_tokens=True)


def complete_row(tokens: dict[str, list[int]], names: list[str]) -> Row:
    """One text's token lists in the order of `names`, from its `input_ids` (and whatever
    else `tokens` holds)."""
    ids = tokens["input_ids"]
    defaults = {"attention_mask": [1] * len(ids), "token_type_ids": [0] * len(ids)}
    return [tokens[name] if name in tokens else defaults[name] for name in names]


def padded(rows: list[Row], pad_id: int, names: list[str],
           left: bool = False) -> tuple[torch.Tensor, ...]:
    """One batch: every input's token lists padded to the longest row (on the left where
    `left`), `pad_id` in input_ids and zeros elsewhere, as int64 tensors."""
    longest = max(len(row[0]) for row in rows)
    columns = []
    for k, name in enumerate(names):
        pad = pad_id if name == "input_ids" else 0
        filled = [([pad] * (longest - len(row[k])) if left else []) + row[k]
                  + ([] if left else [pad] * (longest - len(row[k]))) for row in rows]
        # through numpy: a third of torch.tensor's time on nested lists
        columns.append(torch.from_numpy(numpy.array(filled, dtype=numpy.int64)))
    return tuple(columns)


def length_buckets(lengths: list[int], overhead: int = PASS_OVERHEAD_TOKENS) -> list[list[int]]:
    """The rows (indices into `lengths`) in forward passes of similar length, shortest first:
    sorted by length and cut where it costs least, a pass costing its rows times its longest
    length in padded tokens plus `overhead` tokens for the pass itself (an exact split, by
    dynamic programming over at most MAX_PASS_ROWS rows a pass)."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    cost, cut = [0] + [None] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        longest = lengths[order[end - 1]]
        for begin in range(max(0, end - MAX_PASS_ROWS), end):
            spent = cost[begin] + overhead + (end - begin) * longest
            if cost[end] is None or spent < cost[end]:
                cost[end], cut[end] = spent, begin
    passes, end = [], len(order)
    while end:
        passes.append(order[cut[end]:end])
        end = cut[end]
    return passes[::-1]


def by_length(rows: list[Row], run: Callable[[list[Row]], list[Any]],
              buckets: bool = True) -> list[Any]:
    """`run` over token rows in passes of similar length (`length_buckets`), so that a short
    text is not padded to the batch's longest; its answers back in the rows' order. Without
    `buckets` (an archive's `length_buckets: false`), `run` over all rows at once."""
    if not buckets:
        return run(rows)
    answers: list[Any] = [None] * len(rows)
    for bucket in length_buckets([len(row[0]) for row in rows]):
        for k, answer in zip(bucket, run([rows[k] for k in bucket]), strict=True):
            answers[k] = answer
    return answers


def answer_rows(items: list[Any], owners: list[int],
                run: Callable[[list[Any]], list[Any]]) -> dict[int, list[Any] | Exception]:
    """Each request's answers, one per item (`owners[k]`: the request of item k), from one
    `run` over all items; where it fails, `run` over each request's items alone, and a
    request that fails alone gets its exception."""
    if not items:
        return {}
    try:
        return grouped(run(items), owners)
    except Exception:  # noqa: BLE001 (a failing row must not fail the others)
        logger.exception("a batch of %d rows failed: running each request alone", len(items))
    rows: dict[int, list[Any] | Exception] = {}
    for owner in dict.fromkeys(owners):
        mine = [item for item, o in zip(items, owners, strict=True) if o == owner]
        try:
            rows[owner] = run(mine)
        except Exception as exc:  # noqa: BLE001
            logger.exception("request %d failed alone", owner)
            rows[owner] = exc
    return rows


def grouped(answers: list[Any], owners: list[int]) -> dict[int, list[Any]]:
    """Answers in rows order, grouped by the request that owns each row."""
    by_owner: dict[int, list[Any]] = {}
    for owner, answer in zip(owners, answers, strict=True):
        by_owner.setdefault(owner, []).append(answer)
    return by_owner


def write_answer(context: Any, i: int, result: Any, openai: bool = False) -> str:
    """Answer `i` as strict JSON; an error `(status, message)` also sets its status (its
    body OpenAI's error object where `openai`)."""
    if not isinstance(result, tuple):
        try:
            return json_answer(result)
        except (TypeError, ValueError):
            logger.exception("request %d: its answer is not JSON", i)
            result = (500, "the answer could not be written as JSON")
    status, message = result
    context.set_response_status(status, reason_phrase(message), idx=i)
    record(context, "CompressBadRequests" if status < 500 else "CompressFailedRequests", 1)
    return json_answer(openai_error(message, status) if openai
                       else {"error": message, "status": status})


def answer_batch(data: list[dict[str, Any]], context: Any, model_name: str,
                 route_of: Callable[[str | None], str | None],
                 read: Callable[[Any, str | None], Any],
                 run: Callable[[list[Row]], list[Any]],
                 answer: Callable[[Any, list[Any] | Exception], Any]) -> list[str]:
    """The answers of a batch of requests that each read into token rows (`read(body,
    route)` gives an object with `.rows`, or raises: that request's 400), all requests'
    rows run together (`answer_rows`), each request answered from its rows' results
    (`answer`). `route_of(url_path)`: None for the native route, a route's name, or
    LookupError (a 404); MODELS is answered here. Errors on an OpenAI-style route are in
    OpenAI's shape."""
    results: list[Any] = []
    on_route = [False] * len(data)
    parsed: dict[int, Any] = {}
    for i, request in enumerate(data):
        context.set_response_header(i, BATCH_HEADER, str(len(data)))
        context.set_response_content_type(i, "application/json")
        try:
            route = route_of(context.get_request_header(i, "url_path"))
        except LookupError as exc:
            results.append((404, str(exc)))
            on_route[i] = True
            continue
        on_route[i] = route is not None
        if route == MODELS:
            results.append(openai_models(model_name))
            continue
        try:
            parsed[i] = read(read_body(request, request_content_type(context, i, request)),
                             route)
        except Exception as exc:  # noqa: BLE001 (whatever one request raises is its own)
            results.append((400, refusal(exc)))
            continue
        results.append(None)
    items = [row for i in parsed for row in parsed[i].rows]
    owners = [i for i in parsed for _ in parsed[i].rows]
    rows = answer_rows(items, owners, run)
    for i, one in parsed.items():
        results[i] = answer(one, rows.get(i, []))
    record(context, "CompressBatchRows", len(data))
    return [write_answer(context, i, result, on_route[i]) for i, result in enumerate(results)]

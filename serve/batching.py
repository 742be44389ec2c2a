"""The pieces of a batching handler (shipped in every archive; no compress imports): a text
model's request checked against the archive's limits and read into token rows, a batch of
rows padded into the model's input tensors, one forward pass per TorchServe batch answered
per request, and each answer written.

Where the pass over all good requests' items (texts, arrays) fails, each request is run
alone, so that only a request that fails alone gets its exception. An answer is strict JSON;
an error `(status, message)` sets that request's status alone, with compress's error body
or, on OpenAI's routes, OpenAI's error object."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

try:  # inside the archive the modules lie beside this file
    from handler_metrics import record
    from http_answers import check_unicode, json_answer, openai_error, reason_phrase
except ImportError:  # in the compress repository
    from serve.handler_metrics import record
    from serve.http_answers import check_unicode, json_answer, openai_error, reason_phrase

logger = logging.getLogger(__name__)
BATCH_HEADER = "X-Batch-Size"  # every answer says how many requests shared its batch
Refusal = tuple[int, str]  # (status, message): a request's error answer
NO_TEXT = 'no text: send {"text": "..."}, {"texts": ["...", ...]} or a plain-text body'
# one text's tokens: per input of the model (input_ids, attention_mask, token_type_ids), a list
Row = list[list[int]]


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
    encoded = tokenizer(texts, truncation=True, max_length=max_length)
    return [complete_row({name: encoded[name][r] for name in names if name in encoded}, names)
            for r in range(len(texts))]


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
        columns.append(torch.tensor(filled, dtype=torch.long))
    return tuple(columns)


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

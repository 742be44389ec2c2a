"""A request's rows in the continuous batch, from its parsed body (`parse_choices`) to its
answer: each of its `n` choices is one row, whose `(token, end)` pairs come through a
queue of its own; each new piece of text is sent as it comes (where the request streams),
then the request's last answer is returned (shipped in the causal-LM archive beside
`handler.py`; imports no compress code).

What a stop string held back and never claimed is sent before a choice's end, so that the
deltas add up to the text. A stop string lets the row go (`batcher.cancel`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from serve.handler_metrics import record

from ..runtime.decode import Sampling
from . import grammar as grammars
from . import openai as openai_routes
from . import replies, requests
from .rows import Row


@dataclass
class RowRun:
    """One choice in flight: its batcher row, the queue its tokens come through, its text."""

    row: Row
    queue: asyncio.Queue
    stream: requests.TextStream
    choice: openai_routes.Choice


def parse_choices(request: dict[str, Any], route: str | None, encode,
                  limits: requests.Limits, content_type: str = "") -> tuple[Any, ...]:
    """(the request parsed: one per prompt, what its OpenAI answer carries). ValueError: a
    400."""
    parsed, wanted = requests.parse_request(request, route, encode, limits, content_type)
    if route is None and (parsed[0].n > 1 or parsed[0].logprobs is not None):
        raise ValueError("n and logprobs: on the OpenAI routes (v1/chat/completions, "
                         "v1/completions)")
    return parsed, wanted


async def constraints_of(parsed: requests.GenerationRequest, tokenizer: Any,
                         compiling: grammars.CompileQueue) -> list[Any]:
    """A grammar constraint per choice, or Nones: the request's schema compiled once, on
    `compiling` (a thread of its own at the lowest priority, so that a long compilation
    holds no plain prompt's parse, nor its decode). GrammarError: a 400; QueueFull (too
    many schemas waiting to compile): a 503."""
    if parsed.json_schema is None:
        return [None] * parsed.n
    return await compiling.constraints(tokenizer, parsed.json_schema, parsed.n)


def row_run(k: int, parsed: requests.GenerationRequest, loop: asyncio.AbstractEventLoop,
            constraint: Any, tokenizer: Any, index: int | None = None, echo: bool = False
            ) -> RowRun:
    """Choice `k` of a prompt: its row (its tokens put in a queue of its own; a seed of
    its own, the request's + k) and its text; the request's choice `index` (k where None),
    its prompt's text written before its own where `echo`."""
    queue: asyncio.Queue = asyncio.Queue()
    seed = None if parsed.seed is None else (parsed.seed + k) % requests.SEED_LIMIT
    sampling = (Sampling(parsed.temperature, parsed.top_p, seed)
                if parsed.temperature > 0 else None)
    row = Row(parsed.ids, parsed.max_new_tokens,
              lambda token, end: loop.call_soon_threadsafe(queue.put_nowait, (token, end)),
              sampling, ignore_eos=parsed.ignore_eos, constraint=constraint,
              logprobs=parsed.logprobs, score_prompt=parsed.score_prompt)
    choice = openai_routes.Choice(k if index is None else index)
    if echo:
        choice.echo = parsed.prompt_text if parsed.prompt_text is not None else \
            tokenizer.decode(parsed.ids)
    return RowRun(row, queue, requests.TextStream(tokenizer, parsed.stop), choice)


async def answer_rows(context, i: int, batcher: Any, runs: list[RowRun],
                      prompts: list[requests.GenerationRequest],
                      answer: openai_routes.Answer | None, began: float) -> str:
    """Request `i`'s last answer once every one of its rows has ended (`prompts`: the
    request parsed, one per prompt): the native NDJSON line, OpenAI's stream end or whole
    completion, or a 500 naming the request's id where a row failed (what failed goes to
    the log)."""
    parsed = prompts[0]  # what every prompt of a request shares (stream, stop, ...)
    ends = await asyncio.gather(*(follow(context, i, batcher, run, parsed, answer, began)
                                  for run in runs))
    failure = next((end for end in ends if end), None)
    if failure is not None:
        return replies.internal(context, i, failure, openai=answer is not None,
                                streamed=parsed.stream and any(r.stream.sent for r in runs))
    completion = sum(len(run.stream.tokens) for run in runs)
    if answer is None:
        run = runs[0]
        return json.dumps(replies.native_answer(run.stream.text, len(parsed.ids),
                                                completion, run.choice.finish or "stop")
                          ) + "\n"
    usage = openai_routes.usage(sum(len(p.ids) for p in prompts), completion)
    if parsed.stream:
        return answer.end(usage)
    return json.dumps(answer.whole([run.choice for run in runs], usage))


async def follow(context, i: int, batcher: Any, run: RowRun,
                 parsed: requests.GenerationRequest, answer: openai_routes.Answer | None,
                 began: float) -> str | None:
    """One row to its end, its pieces sent as they come; the failure ("error: ...") or
    None, with `run.choice` holding the text and `finish_reason`."""
    stream, choice, row = run.stream, run.choice, run.row
    while True:
        token, end = await run.queue.get()
        if token is None:
            finish = end or "stop"
            break
        if stream.stopped:
            continue
        if not stream.tokens and choice.index == 0:
            busy = row.beside
            context.set_response_header(i, replies.BATCH_HEADER, str(busy))
            record(context, "CompressBatchRows", busy)
            record(context, "CompressQueueTime", row.admitted - began)
            record(context, "CompressTimeToFirstToken", time.perf_counter() - began)
            held = getattr(getattr(batcher, "prefiller", None), "prefix_cache", None)
            if held is not None:
                record(context, "CompressPrefixCacheBytes", held.bytes)
        piece = stream.add(token)
        if stream.stopped:
            batcher.cancel(row)
        if piece and parsed.stream:
            _send_piece(context, i, answer, run, piece)
    record(context, "CompressGeneratedTokens", len(stream.tokens))
    if row.drafts_verified:
        record(context, "CompressDraftTokens", row.drafts_verified)
        record(context, "CompressDraftTokensKept", row.drafts_kept)
    if finish.startswith("error"):
        return finish
    # "cancelled": the batcher's end of a row that a stop string let go
    choice.finish = "stop" if stream.stopped or finish not in ("length", "stop") else finish
    held = stream.flush()
    choice.text, choice.tokens, choice.logprobs = stream.text, stream.tokens, row.token_logprobs
    if row.score_prompt:
        choice.prompt, choice.prompt_logprobs = row.ids, row.prompt_logprobs
    if parsed.stream and answer is not None:
        replies.send(context, i, answer.last_chunks(choice, "" if answer.holds_text
                                                    else held))
    elif parsed.stream and held:
        replies.send(context, i, replies.native_chunk(held, len(stream.tokens)))
    return None


def _send_piece(context, i: int, answer: openai_routes.Answer | None, run: RowRun,
                piece: str) -> None:
    """A new piece of a choice's text, as OpenAI's event or a native NDJSON line; nothing
    where the text is held for its end (tool calls)."""
    if answer is None:
        replies.send(context, i, replies.native_chunk(piece, len(run.stream.tokens)))
        return
    if answer.holds_text:
        return
    run.choice.tokens, run.choice.logprobs = run.stream.tokens, run.row.token_logprobs
    replies.send(context, i, answer.chunk(run.choice, piece))

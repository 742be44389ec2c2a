"""The request bodies of an OpenAI chat load test: one streamed `/v1/chat/completions`
request per prompt, greedy, with usage asked for; or the shared-prefix workload, where
every request's messages start with the same long system prompt and end with a short
question of its own.

The system prompt is deterministic text of about N tokens: sentences of common English
words, each word one token in a byte-level BPE vocabulary such as SmolLM2's or Llama's
(N words, within a few percent of N tokens; the servers' `usage.prompt_tokens` gives the
exact count). Each question is distinct ("Question 7 of the set: ..." plus a chat prompt),
so no two requests share more than the system prompt and the question's first words.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from compress.errors import UserError

MAX_SHARED_PREFIX = 32_768
# lowercase words that byte-level BPE vocabularies hold whole, with their leading space
_WORD_LIST = """the of and to in is was for on that with as by at from his her they we you
this are be or an but not have had has were which one all their there been if more when
will would who so no out up into than them can only other new some time could these two
may then do first any my now such like our over man me even most made after also did many
before must through back years where much your way well down should because each just
those people how too little state good very make world still own see men work long get
here between both life being under never day same another know while last might us great
old year off come since against go came right used take three"""
_WORDS = tuple(_WORD_LIST.split())
QUESTION = "Question {n} of the set: {prompt}"


def shared_prefix_text(tokens: int, seed: int = 0) -> str:
    """About `tokens` tokens of deterministic text: sentences of 8 to 15 common words and a
    full stop (a token each)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= \
            MAX_SHARED_PREFIX:
        raise UserError(f"shared prefix must be a number of tokens from 1 to "
                        f"{MAX_SHARED_PREFIX}, got {tokens!r}")
    pick = random.Random(seed)
    sentences: list[str] = []
    left = tokens
    while left > 0:
        size = max(1, min(pick.randint(8, 15), left - 1))
        sentences.append(" ".join(pick.choice(_WORDS) for _ in range(size)) + ".")
        left -= size + 1
    return " ".join(sentences)


def read_prompts(prompts_file: str | Path | None, default: tuple[str, ...]) -> list[str]:
    """The non-empty lines of `prompts_file`, or `default`."""
    if not prompts_file:
        return list(default)
    prompts = [line.strip() for line in Path(prompts_file).read_text().splitlines()
               if line.strip()]
    if not prompts:
        raise UserError(f"{prompts_file}: no prompt lines to send")
    return prompts


def chat_body(messages: list[dict[str, str]], max_tokens: int,
              extra: dict[str, Any] | None = None) -> bytes:
    """A streamed, greedy chat completion request that asks for usage in its stream;
    `extra` fields are added as they are (e.g. llama-server's `ignore_eos`)."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    return json.dumps(body).encode()


def chat_payloads(prompts: list[str], max_tokens: int, count: int,
                  shared_prefix: int | None = None,
                  extra: dict[str, Any] | None = None) -> list[bytes]:
    """`count` request bodies, the prompts in turn: one user message each; or, with
    `shared_prefix` tokens, the shared system prompt and then a distinct question."""
    if not prompts:
        raise UserError("no prompts to send: give at least one")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UserError(f"count must be a positive number of requests, got {count!r}")
    if shared_prefix is None:
        return [chat_body([{"role": "user", "content": prompts[i % len(prompts)]}],
                          max_tokens, extra) for i in range(count)]
    system = shared_prefix_text(shared_prefix)
    return [chat_body([{"role": "system", "content": system},
                       {"role": "user", "content": QUESTION.format(
                           n=i + 1, prompt=prompts[i % len(prompts)])}], max_tokens, extra)
            for i in range(count)]

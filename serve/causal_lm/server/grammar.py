"""Constrained decoding: a row whose answer must match a JSON schema (OpenAI's
`response_format`, a tool call's arguments) gets a `Constraint`, which masks the logits the
batcher picks its next token from to the tokens the grammar allows, and follows the tokens
picked (shipped in `causal_lm`; torch, and llguidance where a request asks for it).

The grammar engine is llguidance: a Rust library with a wheel of its own and no Python
dependencies (xgrammar needs triton and apache-tvm-ffi beside torch). Its mask takes about
20 us a token for SmolLM2's 49152-token vocabulary on a Zen 4 core, against a decode step of
5-20 ms, so a row with a grammar costs the rows without one next to nothing.

JSON is written without free whitespace (`", "` and `": "` between items): a model that may
put any whitespace between tokens can fill its whole answer with it.

Compiling a schema costs about as much as building a matcher for it (1.5 s and 1.8 s for a
0.7 MB anyOf of 6,000 objects on a Zen 5 core), and llguidance may take a second to refuse
one: `constraints` compiles a schema once and gives each of a request's choices a
`deep_copy()` of its matcher (milliseconds), and keeps the last COMPILED_KEPT schemas'
matchers, or their refusals, for the requests that send the same text again.

`CompileQueue` runs those compilations on one thread of the lowest CPU priority, so that
under load the decode loop and the prompts' parse keep the cores and schemas compile in
what is left; at most `bound` schemas wait for it (past that, a 503 with Retry-After), so
structured-output requests never fill the batcher's queue while they wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import math
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .rows import QueueFull

# JSON's layout inside a grammar: compact, readable, and never an endless run of spaces
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_tokenizers: dict[int, Any] = {}  # id(HF tokenizer) -> (that tokenizer, llguidance's)
COMPILED_KEPT = 32  # schemas whose matcher (or refusal) is kept, the least recent dropped
# (id(llguidance's tokenizer), the schema's text) -> a Constraint never advanced, or the
# refusal's message
_compiled: OrderedDict[tuple[int, str], Any] = OrderedDict()
_compiled_lock = threading.Lock()


class GrammarError(ValueError):
    """A schema the engine cannot compile, or a tokenizer it cannot read: a 400."""


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf  # noqa: F401 (llguidance.hf.from_tokenizer)
    except ImportError:
        raise GrammarError("structured output needs llguidance on the server "
                           "(pip install llguidance)") from None
    return llguidance


def engine_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of a Hugging Face tokenizer, made once per tokenizer (about 0.3 s
    for a 49k vocabulary). GrammarError where llguidance cannot read it (a WordPiece one)."""
    held = _tokenizers.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        llguidance = _llguidance()
        try:
            held = (tokenizer, llguidance.hf.from_tokenizer(tokenizer))
        except (ValueError, TypeError, AttributeError) as exc:
            raise GrammarError(f"structured output is not available for this model: its "
                               f"tokenizer cannot be read by the grammar engine ("
                               f"{str(exc).splitlines()[0][:160]})") from None
        _tokenizers[id(tokenizer)] = held
    return held[1]


def json_grammar(schema: dict[str, Any]) -> str:
    """The grammar of JSON text that validates against `schema`; GrammarError names what the
    engine refused."""
    llguidance = _llguidance()
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                defaults=JSON_LAYOUT)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema cannot be used: {_first_line(exc)}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise GrammarError(f"the JSON schema cannot be used: {_first_line(messages[0])}")
    return grammar


def constraints(tokenizer: Any, schema: dict[str, Any], n: int) -> list[Constraint]:
    """`n` constraints of JSON valid against `schema`, each following its own row: the
    schema compiled once (or taken from the last COMPILED_KEPT that were), then copied.
    GrammarError: the engine refused it (refused again at once for the same text)."""
    engine = engine_tokenizer(tokenizer)
    key = (id(engine), json.dumps(schema))
    with _compiled_lock:
        held = _compiled.get(key)
        if held is not None:
            _compiled.move_to_end(key)
    if held is None:
        try:
            held = Constraint(tokenizer, json_grammar(schema))
        except GrammarError as exc:
            held = str(exc)
        with _compiled_lock:
            _compiled[key] = held
            while len(_compiled) > COMPILED_KEPT:
                _compiled.popitem(last=False)
    if isinstance(held, str):
        raise GrammarError(held)
    return [held.copy() for _ in range(n)]


def is_compiled(tokenizer: Any, schema: dict[str, Any]) -> bool:
    """Whether `constraints` has this schema's matcher (or refusal) at hand: no compiling.
    Cheap enough for the event loop: it never builds llguidance's view of the tokenizer
    (0.3 s), and a tokenizer without one has compiled nothing."""
    held = _tokenizers.get(id(tokenizer))
    if held is None or held[0] is not tokenizer:
        return False
    with _compiled_lock:
        return (id(held[1]), json.dumps(schema)) in _compiled


def _lowest_priority() -> None:
    """The calling thread at nice 19 (Linux takes a thread's id here; elsewhere, as it was)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class CompileQueue:
    """Schemas compiled on one thread at the lowest CPU priority, at most `bound` of them
    waiting or compiling (0: no bound); a schema already compiled skips the bound."""

    def __init__(self, bound: int):
        self.bound, self.waiting = bound, 0
        self.last_s = 0.1  # the last compilation's seconds (`Retry-After`)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="grammar",
                                           initializer=_lowest_priority)

    async def constraints(self, tokenizer: Any, schema: dict[str, Any], n: int
                          ) -> list[Constraint]:
        """`constraints(tokenizer, schema, n)` off the event loop; QueueFull when `bound`
        schemas wait already, GrammarError when the engine refuses it."""
        if self.bound and self.waiting >= self.bound and not is_compiled(tokenizer, schema):
            retry = max(1, min(60, math.ceil(self.waiting * self.last_s)))
            raise QueueFull(self.waiting, retry, what="JSON schemas are compiling")
        self.waiting += 1  # on the event loop's thread only: no lock
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.executor, self._timed, tokenizer, schema, n)
        finally:
            self.waiting -= 1

    def _timed(self, tokenizer: Any, schema: dict[str, Any], n: int) -> list[Constraint]:
        began = time.perf_counter()
        try:
            return constraints(tokenizer, schema, n)
        finally:
            self.last_s = time.perf_counter() - began


def _first_line(message: object) -> str:
    return (str(message).strip().splitlines() or ["?"])[0][:300]


class Constraint:
    """One row's grammar: `mask(logits)` forbids (-inf) what it does not allow next,
    `advance(token)` takes the token picked. Where the grammar is complete, only the end
    token is allowed, so the row stops."""

    def __init__(self, tokenizer: Any, grammar: str):
        llguidance = _llguidance()
        self.engine_tokenizer = engine_tokenizer(tokenizer)
        self.matcher = llguidance.LLMatcher(self.engine_tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot be used: "
                               f"{_first_line(self.matcher.get_error())}")
        words = (self.engine_tokenizer.vocab_size + 31) // 32
        self.bits = torch.zeros(words, dtype=torch.int32)
        self.shifts = torch.arange(32, dtype=torch.int32)

    def copy(self) -> Constraint:
        """A constraint at this one's state that follows a row of its own (llguidance's
        `deep_copy`: milliseconds, where a new matcher compiles the grammar again)."""
        twin = copy.copy(self)
        twin.matcher = self.matcher.deep_copy()
        twin.bits = torch.zeros_like(self.bits)
        return twin

    def allowed(self) -> torch.Tensor:
        """A bool per token id: whether the grammar allows it next."""
        self.matcher.unsafe_compute_mask_ptr(self.bits.data_ptr(), self.bits.numel() * 4)
        return ((self.bits[:, None] >> self.shifts) & 1).bool().view(-1)

    def mask(self, logits: torch.Tensor) -> None:
        """`logits` (one row, vocab) with what the grammar forbids set to -inf, in place;
        ids past the engine's vocabulary (a padded head) are forbidden."""
        allowed = self.allowed()
        if not allowed.any():  # the engine failed (`failed`): the row ends here
            allowed[self.engine_tokenizer.eos_token] = True
        vocab = logits.shape[-1]
        if allowed.numel() < vocab:
            allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.numel())])
        logits.masked_fill_(~allowed[:vocab], float("-inf"))

    def advance(self, token: int) -> None:
        """Take the token picked (an end token once the grammar is complete is fine)."""
        self.matcher.consume_token(token)

    @property
    def failed(self) -> str:
        """The engine's error, "" while it follows (a token outside its mask was taken)."""
        return self.matcher.get_error() if self.matcher.is_error() else ""

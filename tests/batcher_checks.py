"""Continuous-batching checks shared by the unit tier (eager decoders) and the integration
tier (the same checks through Inductor-compiled decoders)."""

from __future__ import annotations

import queue
import threading

import torch

from serve.causal_lm.runtime.decode import Sampling, StaticDecoder
from serve.causal_lm.server.aot_steps import use_step
from serve.causal_lm.server.batcher import ContinuousBatcher, Row
from serve.causal_lm.server.compiled_graphs import warm_up
from serve.causal_lm.server.prefill import Prefiller
from serve.causal_lm.server.speculation import eager_verify

CACHE = 64


def varied_model(**sizes: int):
    """A 2-layer, 32-wide random Llama over 97 tokens whose greedy tokens vary; `sizes`:
    LlamaConfig values in place of those."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "tie_word_embeddings": False, "initializer_range": 0.1, **sizes})
    return LlamaForCausalLM(config).eval()


def batcher_of(model, sizes=(1, 2, 4), compile_mode: str | None = None,
               own_thread: bool = True, steps: dict | None = None, speculate: int = 0,
               **prefill):
    """A batcher of decoders (one per bucket, compiled in `compile_mode` where given, or
    decoding through the AOTInductor `steps` by their fewest rows), their caches shared;
    `speculate`: drafts a row verifies at most, eagerly; `prefill`: the Prefiller's options
    (compiled with the decoders)."""
    decoders = {rows: StaticDecoder(model, CACHE, always_mask=True) for rows in sizes}
    for rows, decoder in decoders.items():
        if steps:
            use_step(decoder, steps[min(rows, 2)])
        elif compile_mode:
            decoder.compile(compile_mode)
    warm_up(decoders, shared=True)  # as the handler does: one cache, its rows dynamic
    prefiller = Prefiller(model, CACHE, compiled=bool(compile_mode), **prefill)
    if compile_mode:
        prefiller.warm_up()
    verify = eager_verify(model, {r: d.cache for r, d in decoders.items()}) if speculate else None
    return ContinuousBatcher(decoders, prefiller, stop=set(), own_thread=own_thread,
                             speculate=speculate, verify=verify)


def alone(model, ids: list[int], new: int, sampling: Sampling | None = None,
          cache_len: int = CACHE) -> list[int]:
    out = StaticDecoder(model, cache_len).generate([ids], new, sampling=[sampling])
    return out.tokens


class Collect:
    """A row's tokens and end, as the batcher emits them. With `hold_at`, the batcher's
    thread waits in the emit of that many events until `release` is set: the row's position
    stays put while the test submits the next (a race on a busy machine otherwise)."""

    def __init__(self, hold_at: int | None = None) -> None:
        self.events: queue.Queue = queue.Queue()
        self.tokens: list[int] = []
        self.hold_at, self.emitted, self.release = hold_at, 0, threading.Event()

    def emit(self, token, end) -> None:
        self.events.put((token, end))
        self.emitted += 1
        if self.emitted == self.hold_at:
            assert self.release.wait(60), "the test never released the batcher"

    def wait(self, timeout: float = 60) -> str:
        while True:
            token, end = self.events.get(timeout=timeout)
            if token is None:
                return end
            self.tokens.append(token)

    def wait_for(self, count: int) -> None:
        while len(self.tokens) < count:
            token, end = self.events.get(timeout=60)
            assert token is not None, end
            self.tokens.append(token)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(1, 97, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def rows_joining_at_any_step_decode_their_tokens_alone(model, monkeypatch,
                                                       compile_mode: str | None = None,
                                                       steps: dict | None = None,
                                                       **prefill) -> None:
    """Rows joining at any step, through cursor moves both ways, each decode the tokens
    their prompt gets alone; `prefill`: the Prefiller's options (a shipped `package`)."""
    moves: list[int] = []
    move = ContinuousBatcher._move
    monkeypatch.setattr(ContinuousBatcher, "_move",
                        lambda self, *a: (moves.append(a[2]), move(self, *a))[1])
    from torch._dynamo.utils import counters

    batcher = batcher_of(model, compile_mode=compile_mode, steps=steps, **prefill)
    graphs = counters["stats"]["unique_graphs"]
    rows = []

    def submit(length: int, new: int, seed: int, hold_at: int | None = None) -> Collect:
        return together((length, new, seed, hold_at))[0]

    def together(*asked: tuple[int, int, int, int | None]) -> list[Collect]:
        """Rows queued at once (the batcher admits those that fit in one prefill: however
        the test's thread is scheduled, two or more rows are prefilled together)."""
        made = []
        for length, new, seed, hold_at in asked:
            got = Collect(hold_at)
            ids = prompt(length, seed)
            made.append((Row(ids, new, got.emit), ids, new, got))
        batcher.submit_all([row for row, *_ in made])
        rows.extend((ids, new, got) for _, ids, new, got in made)
        return [got for *_, got in made]

    first = submit(3, 20, 1, hold_at=2)
    first.wait_for(2)
    second = submit(9, 12, 2)  # longer than the cursor (5): every row moves right
    first.release.set()
    second.wait_for(1)
    together((5, 30, 3, None), (2, 6, 4, None),
             (7, 4, 5, None))  # two join the two running rows; a fifth waits for a slot
    ends = [got.wait() if got not in (first, second) else None for _, _, got in rows]
    ends[0], ends[1] = first.wait(), second.wait()
    # a late row stays; the cursor would run past the cache for the next: rows move left
    early = submit(2, 20, 6, hold_at=15)
    early.wait_for(15)
    late = submit(3, 40, 7, hold_at=8)  # still decoding when the last row comes
    early.release.set()
    late.wait_for(1)
    ends += [early.wait()]
    last = submit(3, 45, 8)
    late.release.set()
    ends += [late.wait(), last.wait()]
    assert ends == ["length"] * 8
    for ids, new, got in rows:
        assert got.tokens == alone(model, ids, new), (ids, new)
    assert batcher.busy() == 0 and batcher.steps > 0
    assert min(moves) < 0 < max(moves), moves  # both moves happened
    # compiled: every graph was compiled before the first request (two decode graphs, one
    # for 1 row and one for more, and the same two for the prefill); none while serving
    assert counters["stats"]["unique_graphs"] == graphs

"""Continuous batching (serve/lm_batcher.py) on a tiny random Llama: rows that join a running
decode, at any step, with prompts of any lengths, through cursor moves left and right, decode
the tokens each prompt gets alone; cancelled rows free their slots; a seeded sample is the
same as alone."""

from __future__ import annotations

import queue
import time

import pytest
import torch

from serve import lm_batcher
from serve.lm_decode import Sampling, StaticDecoder

CACHE = 64


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         initializer_range=0.1)
    return LlamaForCausalLM(config).eval()


def batcher_of(model, sizes=(1, 2, 4), compile_mode: str | None = None):
    decoders = {rows: StaticDecoder(model, CACHE, always_mask=True) for rows in sizes}
    if compile_mode:
        for decoder in decoders.values():
            decoder.compile(compile_mode)
    for n, rows in enumerate(sorted(decoders, reverse=True)):
        decoders[rows].generate([[0]] * rows, 2)
        if n == 0:
            lm_batcher.shared_caches(decoders)
    return lm_batcher.ContinuousBatcher(decoders, StaticDecoder(model, CACHE), stop=set())


def alone(model, ids: list[int], new: int, sampling: Sampling | None = None) -> list[int]:
    out = StaticDecoder(model, CACHE).generate([ids], new, sampling=[sampling])
    return out.tokens


class Collect:
    """A row's tokens and end, as the batcher emits them."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self.tokens: list[int] = []

    def emit(self, token, end) -> None:
        self.events.put((token, end))

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


@pytest.mark.parametrize("compile_mode", [None, "default"])
def test_rows_joining_at_any_step_decode_their_tokens_alone(model, compile_mode,
                                                            monkeypatch) -> None:
    moves: list[int] = []
    move = lm_batcher.ContinuousBatcher._move
    monkeypatch.setattr(lm_batcher.ContinuousBatcher, "_move",
                        lambda self, *a: (moves.append(a[2]), move(self, *a))[1])
    batcher = batcher_of(model, compile_mode=compile_mode)
    rows = []

    def submit(length: int, new: int, seed: int) -> Collect:
        got = Collect()
        ids = prompt(length, seed)
        batcher.submit(lm_batcher.Row(ids, new, got.emit))
        rows.append((ids, new, got))
        return got

    first = submit(3, 20, 1)
    first.wait_for(2)
    second = submit(9, 12, 2)  # longer than the cursor: every row moves right
    second.wait_for(1)
    submit(5, 30, 3)
    submit(2, 6, 4)
    submit(7, 4, 5)  # a fifth row waits for a free slot
    ends = [got.wait() if got not in (first, second) else None for _, _, got in rows]
    ends[0], ends[1] = first.wait(), second.wait()
    # a late row stays; the cursor would run past the cache for the next: rows move left
    early = submit(2, 20, 6)
    early.wait_for(15)
    late = submit(3, 40, 7)
    late.wait_for(1)
    ends += [early.wait()]
    last = submit(3, 45, 8)
    ends += [late.wait(), last.wait()]
    assert ends == ["length"] * 8
    for ids, new, got in rows:
        assert got.tokens == alone(model, ids, new), (ids, new)
    assert batcher.busy() == 0 and batcher.steps > 0
    assert min(moves) < 0 < max(moves), moves  # both moves happened


def test_cancelled_rows_leave_and_a_full_batch_works_after(model) -> None:
    batcher = batcher_of(model)
    gone = [Collect() for _ in range(4)]
    rows = [batcher.submit(lm_batcher.Row(prompt(4, i), 40, g.emit)) for i, g in enumerate(gone)]
    gone[0].wait_for(3)
    for row in rows:
        batcher.cancel(row)
    assert [g.wait() for g in gone] == ["cancelled"] * 4
    deadline = time.time() + 10
    while batcher.busy() and time.time() < deadline:
        time.sleep(0.01)
    assert batcher.busy() == 0
    after = [Collect() for _ in range(4)]
    ids = [prompt(6, 10 + i) for i in range(4)]
    for i, g in zip(ids, after, strict=True):
        batcher.submit(lm_batcher.Row(i, 10, g.emit))
    assert [g.wait() for g in after] == ["length"] * 4
    assert [g.tokens for g in after] == [alone(model, i, 10) for i in ids]


def test_a_seeded_sample_is_the_same_as_alone(model) -> None:
    batcher = batcher_of(model)
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=7)
    greedy, sampled = Collect(), Collect()
    batcher.submit(lm_batcher.Row(prompt(5, 1), 16, greedy.emit))
    batcher.submit(lm_batcher.Row(prompt(4, 2), 16, sampled.emit, sampling))
    assert sampled.wait() == "length" and greedy.wait() == "length"
    assert sampled.tokens == alone(model, prompt(4, 2), 16, sampling)
    assert greedy.tokens == alone(model, prompt(5, 1), 16)


def test_a_request_longer_than_the_cache_is_refused(model) -> None:
    batcher = batcher_of(model, sizes=(1,))
    with pytest.raises(ValueError, match="exceeds the cache"):
        batcher.submit(lm_batcher.Row(prompt(40, 0), 30, Collect().emit))


def test_a_top_p_below_float32s_least_picks_the_likeliest_token() -> None:
    """Found by fuzzing the served routes: top_p 1e-300 (0 in float32) kept no token and
    multinomial failed the whole decode."""
    from serve.lm_decode import pick_tokens

    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(0))
    picked = pick_tokens(logits, [Sampling(10.0, 1e-300, 0), None],
                         [torch.Generator().manual_seed(0), None])
    assert picked.tolist() == logits.argmax(-1).tolist()

"""Batch invariance, the rule `docs/causal-lm.md` states: a model whose products run on
compress's kernels gives a row the same logits, bit for bit, alone and beside any other
rows, in every activation mode (float32, int8, bf16), through continuous batching's rows
joining and leaving, its left padding, and its prefill chunks. The attention that keeps
it (`cache_attention.cpp`) is checked against the plain softmax attention too. Built
kernels (about a minute the first time), so outside the unit tier."""

from __future__ import annotations

import random
import time

import pytest
import torch
from batcher_checks import batcher_of

from serve.causal_lm.runtime import grouped
from serve.causal_lm.runtime.attention import (
    INVARIANT_ATTENTION,
    attention,
    decode_attention_for,
)
from serve.causal_lm.runtime.kernels import build_error, grouped_mm_available
from serve.causal_lm.runtime.loading import quantize_weights
from serve.causal_lm.server import batcher as batcher_module
from serve.causal_lm.server.batcher import Row

pytestmark = pytest.mark.skipif(not grouped_mm_available(), reason=str(build_error()))


def attention_reference(query, key, value, valid):
    """Softmax attention in float64 (query B x H x T x D, key and value B x KVH x L x D,
    valid B x T x L), as B x T x H x D."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.double().repeat_interleave(group, 1) for t in (key, value))
    scores = query.double() @ key.transpose(-1, -2) * query.shape[-1] ** -0.5
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    return (scores.softmax(-1) @ value).transpose(1, 2)


def test_cache_attention_is_softmax_attention_and_each_rows_own() -> None:
    torch.manual_seed(0)
    rows, heads, kv_heads, dim, cached = 3, 6, 2, 40, 23
    key, value = torch.randn(rows, kv_heads, cached, dim), torch.randn(rows, kv_heads, cached, dim)
    op = torch.ops.compress_lm.cache_attention
    for length in (1, 5):
        query = torch.randn(rows, heads, length, dim)
        starts = torch.tensor([0, 4, 11])  # left padding: each row's first position
        position = torch.arange(cached)
        last = cached - length + torch.arange(length)  # each query's own position
        valid = (position >= starts[:, None, None]) & (position <= last[None, :, None])
        got = op(query, key, value, valid, dim ** -0.5)
        assert got.shape == (rows, length, heads, dim)
        want = attention_reference(query, key, value, valid)
        assert (got.double() - want).abs().max() < 1e-5
        # without a mask: causal, the queries the last `length` positions
        causal = (position <= last[:, None]).expand(rows, length, cached)
        assert torch.equal(op(query, key, value, None, dim ** -0.5),
                           op(query, key, value, causal, dim ** -0.5))
        # row 2 alone, its cache cut to its own positions: the same bits
        own = slice(int(starts[2]), cached)
        alone = op(query[2:], key[2:, :, own], value[2:, :, own], valid[2:, :, own],
                   dim ** -0.5)
        assert torch.equal(alone, got[2:])
    nothing = torch.zeros(1, 1, cached, dtype=torch.bool)  # an empty slot: zeros, not NaN
    assert torch.equal(op(torch.randn(1, heads, 1, dim), key[:1], value[:1], nothing, 1.0),
                       torch.zeros(1, 1, heads, dim))


def tiny_llama(scheme: str, activations: str):
    """A 2-layer, 64-wide random Llama over 97 tokens, its weights on the kernels."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True,
                         initializer_range=0.1)
    return quantize_weights(LlamaForCausalLM(config).eval(), scheme, activations=activations)


@pytest.mark.parametrize("activations", grouped.ACTIVATIONS)
@pytest.mark.parametrize("scheme", ["int8_grouped", "int4_grouped"])
def test_rows_joining_and_leaving_get_their_alone_logits_bit_for_bit(
        scheme, activations, monkeypatch) -> None:
    """Twelve requests of random lengths arrive at random moments in a batcher of 4 rows
    (buckets of 1, 2 and 4, prefills of several prompts left-padded and chunked between
    steps); then each goes again alone. Every logits row each request got, the prefill's
    and every decode step's, is the same bits both times."""
    rows_get_their_alone_logits(tiny_llama(scheme, activations), monkeypatch,
                                f"{scheme}-{activations}")


@pytest.mark.parametrize("style", ["mixtral", "olmoe"])
def test_a_mixture_of_experts_routes_each_row_as_alone(style, monkeypatch) -> None:
    """The same through a mixture of experts (mixtral: the moefy stage's style): the
    routers' logits are summed per token (`experts.route`), the routed experts go in
    ascending order per token."""
    from moe_models import tiny_moe

    model, _ = tiny_moe(style)
    quantize_weights(model, "int8_grouped")
    rows_get_their_alone_logits(model, monkeypatch, style)


def test_compiled_steps_keep_the_rule(monkeypatch) -> None:
    """Through Inductor-compiled decode steps and prefill (as a worker compiles them where
    its archive ships no packages), int4 weights, int8 activations: the same bits alone
    and together."""
    rows_get_their_alone_logits(tiny_llama("int4_grouped", "int8"), monkeypatch, "compiled",
                                compile_mode="default")


def test_shipped_aot_steps_keep_the_rule(monkeypatch, tmp_path) -> None:
    """Through the AOTInductor packages a served archive decodes and prefills with by
    default (decode: one for 1 row, one for 2-4; the prefill: one for 1-4): the same bits
    alone and together."""
    from batcher_checks import CACHE

    from serve.causal_lm.server import aot_steps

    model = tiny_llama("int8_grouped", "float32")
    aot_steps.export_steps(model, 4, CACHE, "default", tmp_path)
    aot_steps.export_prefill(model, 4, CACHE, "default", tmp_path)
    prefill = aot_steps.LoadedPrefill(aot_steps.load_prefill(tmp_path, model), 4, True)
    rows_get_their_alone_logits(model, monkeypatch, "aoti",
                                steps=aot_steps.load_steps(tmp_path, model), package=prefill)


def recorded_picks(monkeypatch, *modules) -> dict[int, list[torch.Tensor]]:
    """Every logits row each row's tokens are picked from, by `id(row)`, through the
    `pick_for_rows` of `modules` (the batcher's, and speculation's where it verifies)."""
    seen: dict[int, list[torch.Tensor]] = {}
    pick = batcher_module.pick_for_rows

    def recording(logits: torch.Tensor, rows: list) -> list[int]:
        for k, row in enumerate(rows):
            if row is not None:
                seen.setdefault(id(row), []).append(logits[k].clone())
        return pick(logits, rows)

    for module in modules:
        monkeypatch.setattr(module, "pick_for_rows", recording)
    return seen


def submitted(batcher, ids: list[int], new: int) -> tuple[Row, list[int], list[str]]:
    """A request queued: (its row, its tokens as they come, its end once it comes)."""
    tokens: list[int] = []
    ends: list[str] = []
    row = Row(ids, new, lambda token, end: tokens.append(token) if token is not None
              else ends.append(end))
    batcher.submit(row)
    return row, tokens, ends


def assert_alone_logits(seen: dict[int, list[torch.Tensor]], requests: list, together: list,
                        alone) -> None:
    """Each request run again by `alone(ids, new)` (to its end) ends as it did together,
    with the same tokens, each picked from the same logits bit for bit."""
    kept = []  # every row stays alive: `seen` goes by id
    for (ids, new), (row, tokens, ends) in zip(requests, together, strict=True):
        alone_row, alone_tokens, alone_ends = alone(ids, new)
        kept.append(alone_row)
        assert ends == alone_ends == ["length"]
        assert alone_tokens == tokens and len(tokens) == new
        batched, by_itself = seen[id(row)], seen[id(alone_row)]
        assert len(batched) == len(by_itself) == new
        for step, (a, b) in enumerate(zip(batched, by_itself, strict=True)):
            assert torch.equal(a, b), (ids, step, float((a - b).abs().max()))


def rows_get_their_alone_logits(model, monkeypatch, seed: str,
                                compile_mode: str | None = None,
                                steps: dict | None = None, **prefill) -> None:
    seen = recorded_picks(monkeypatch, batcher_module)
    assert decode_attention_for(model) == INVARIANT_ATTENTION
    batcher = batcher_of(model, sizes=(1, 2, 4), compile_mode=compile_mode, steps=steps,
                         **prefill)
    chance = random.Random(seed)
    requests = [(torch.randint(1, 97, (chance.randint(2, 20),),
                               generator=torch.Generator().manual_seed(seed)).tolist(),
                 chance.randint(3, 16)) for seed in range(12)]

    together = []
    for ids, new in requests:  # random arrivals: some join a full batch, some an idle one
        together.append(submitted(batcher, ids, new))
        time.sleep(chance.choice([0, 0, 0.002, 0.01, 0.03]))
    for _, _, ends in together:
        wait_for_end(ends)
    assert batcher.steps > 0

    def alone(ids: list[int], new: int) -> tuple[Row, list[int], list[str]]:
        answer = submitted(batcher, ids, new)
        wait_for_end(answer[2])
        return answer

    assert_alone_logits(seen, requests, together, alone)


def wait_for_end(ends: list[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ends and time.monotonic() < deadline:
        time.sleep(0.002)
    assert ends, "the request never ended"


@pytest.mark.parametrize("how", ["eager-float32", "eager-int8", "shipped"])
def test_speculating_rows_get_their_plain_alone_logits_bit_for_bit(
        how, monkeypatch, tmp_path) -> None:
    """Speculation inside the batch (`server/speculation.py`): six requests whose prompts
    repeat a phrase (drafts found) or do not, in a batcher of 4 rows verifying up to 3
    drafts a step (eagerly, or through the shipped verification package with the shipped
    steps), then each alone in a batcher that does not speculate. The logits each token was
    picked from, and so the tokens, are the same bits both ways; drafts were kept."""
    from batcher_checks import CACHE

    from serve.causal_lm.server import aot_steps
    from serve.causal_lm.server import speculation as speculation_module
    from serve.causal_lm.server.speculation import package_verify

    model = tiny_llama("int8_grouped", "int8" if how == "eager-int8" else "float32")
    steps = None
    if how == "shipped":
        aot_steps.export_steps(model, 4, CACHE, "default", tmp_path)
        aot_steps.export_verify(model, 4, CACHE, 3, "default", tmp_path)
        steps = aot_steps.load_steps(tmp_path, model)
    seen = recorded_picks(monkeypatch, batcher_module, speculation_module)
    # driven on this thread, in turn (a batcher's own thread holds the model in its
    # attention while it lives: a second batcher's decoders would not find the model's own)
    speculating = batcher_of(model, steps=steps, speculate=3, own_thread=False)
    plain = batcher_of(model, steps=steps, own_thread=False)
    if how == "shipped":
        packages = aot_steps.load_prefill(tmp_path, model, (aot_steps.VERIFY,
                                                            aot_steps.VERIFY_ONE))
        caches = {rows: d.cache for rows, d in speculating.decoders.items()}
        speculating.verify = package_verify(packages, caches, None, 3)  # no fallback
    chance = random.Random(how)
    requests = []
    for seed in range(6):
        phrase = torch.randint(1, 97, (chance.randint(2, 6),),
                               generator=torch.Generator().manual_seed(seed)).tolist()
        requests.append((phrase * (3 if seed % 3 else 1), chance.randint(8, 20)))

    def drain(batcher) -> None:
        largest = batcher.decoders[batcher.rows]
        with torch.inference_mode(), attention(largest.model, largest.attention):
            while not batcher.idle():
                batcher.turn()

    together = [submitted(speculating, ids, new) for ids, new in requests]
    drain(speculating)
    assert speculating.verifications > 0 and speculating.accepted > 0

    def alone(ids: list[int], new: int) -> tuple[Row, list[int], list[str]]:
        answer = submitted(plain, ids, new)
        drain(plain)
        return answer

    assert_alone_logits(seen, requests, together, alone)

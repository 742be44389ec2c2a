"""Exact speculative decoding with prompt-lookup drafts, at batch 1, over a `StaticDecoder`
(torch and transformers only; shipped beside `decode.py`).

Drafts are copied, not predicted: the last 1..3 tokens of the prompt and the text so far are
looked up at their most recent earlier occurrence, and the `k` tokens that followed it are
proposed (`draft_tokens`). One forward over [last token, d1..dk] at cache positions
p..p+k verifies them all: a greedy row keeps the drafts that equal the model's argmax, then
the model's own next token; a sampled row keeps each draft t with probability p(t) and on
the first rejection samples from p without t (`accept_sampled`: the standard rule for a
point-mass draft, so the tokens follow the plain sampler's distribution, not its draws).

Greedy rows get plain decoding's tokens by construction where the verifying forward
computes, bit for bit, what a one-token decode step computes at each position: its
attention (`verify_attention`) is `decode_attention`'s arithmetic query by query (not
SDPA, whose other summation order would move the logits), norms work row by row. A model
on compress's kernels verifies through the attention its steps run (`cache_attention`:
each query over its own positions, in order) and its kernels sum every row as a lone row
(batch invariance, `docs/causal-lm.md`), so its logits are equal at any k and head size
(SmolLM2's int8_grouped and int4_grouped, eager and compiled: checked). A float model's
products (torch's GEMM) may sum in another order for more rows, which moves logits by
float32 rounding; `SpeculativeGeneration.closest` reports the smallest top-two margin a
verification decided on. Rejected positions need no rollback
beyond the cache's write cursor (`cumulative_length`): a query reads only positions up to
its own, all written by accepted tokens, and stale ones are written over before any query
reaches them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .attention import INVARIANT_ATTENTION, attention
from .decode import Generation, Sampling, StaticDecoder, plan_rows
from .static_cache import tie_graphs_to

VERIFY_ATTENTION = "compress_verify"  # the attention of the verifying forward
VERIFY_ROWS_ATTENTION = "compress_verify_rows"  # ... of rows beside each other, masked


def draft_tokens(history: Sequence[int], n_max: int = 3, n_min: int = 1,
                 k: int = 4) -> list[int]:
    """Prompt lookup: the `k` tokens that followed the most recent earlier occurrence of the
    last n tokens of `history` (longest n first, from `n_max` down to `n_min`), or [] where
    none recurs. A match close to the end continues into its own copy (a repeating cycle
    repeats), so a found draft always has `k` tokens."""
    size = len(history)
    for n in range(min(n_max, size - 1), max(n_min, 1) - 1, -1):
        tail = list(history[size - n:])
        last = tail[-1]
        for start in range(size - n - 1, -1, -1):
            if history[start + n - 1] == last and list(history[start:start + n]) == tail:
                seq = list(history[start + n:])
                while len(seq) < k:  # the copy goes on reading what it just copied
                    seq.append(seq[len(seq) - (size - start - n)])
                return seq[:k]
    return []


def verify_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None,
                     decode_window: torch.Tensor | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of Q new tokens a row, the last Q of the first `len(decode_window)` cache
    positions, each query over the positions up to its own and, where a mask is given
    (VERIFY_ROWS_ATTENTION: rows beside each other, `server/speculation.py`), those it
    opens. `decode_attention`'s arithmetic, query by query: the same float32 products and
    sums, the later positions' scores -inf (weight 0), so each query's output equals, bit
    for bit, a decode step's at its position (eager and compiled; checked)."""
    if decode_window is None:
        raise ValueError("verify_attention needs the decode window")
    filled, count = decode_window.shape[0], query.shape[2]
    key, value = key[:, :, :filled], value[:, :, :filled]
    rows, heads, _, dim = query.shape
    groups = key.shape[1]
    scale = scaling if scaling is not None else dim ** -0.5
    grouped = query.reshape(rows, groups, heads // groups, count, 1, dim).float()
    scores = (grouped * key[:, :, None, None].float()).sum(-1) * scale  # .., queries, L
    seen = torch.arange(filled)[None, :] <= torch.arange(filled - count, filled)[:, None]
    if attention_mask is not None:  # rows x 1 x queries x positions: bool, or added
        mask = attention_mask[:, 0, -count:, :filled]
        mask = mask if mask.dtype == torch.bool else mask == 0
        seen = (seen & mask).reshape(mask.shape[0], 1, 1, count, filled)
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    out = (weights[..., None] * value[:, :, None, None].float()).sum(-2)  # .., queries, dim
    return out.to(query.dtype).reshape(rows, heads, count, dim).transpose(1, 2), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def register_verify_attention() -> None:
    """Make `verify_attention` known to transformers under VERIFY_ATTENTION (no mask built)
    and VERIFY_ROWS_ATTENTION (the padding and causal mask built)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VERIFY_ATTENTION, verify_attention)
    AttentionMaskInterface.register(VERIFY_ATTENTION, _no_mask)
    AttentionInterface.register(VERIFY_ROWS_ATTENTION, verify_attention)
    AttentionMaskInterface.register(VERIFY_ROWS_ATTENTION, sdpa_mask)


def verify_forward(model: nn.Module, cache: Any, ids: torch.Tensor, positions: torch.Tensor,
                   window: torch.Tensor) -> torch.Tensor:
    """Logits (Q x vocab) of every position of `ids` (1 x Q) written to `cache` at
    `positions` (the cache's write position set there), attending to the first
    `len(window)` positions (run under VERIFY_ATTENTION)."""
    out = model(input_ids=ids, cache_position=positions, past_key_values=cache,
                use_cache=True, decode_window=window)
    return out.logits[0]


def target_probs(logits: torch.Tensor, how: Sampling) -> torch.Tensor:
    """The distribution (rows x vocab) `pick_tokens` samples from: softmax at the
    temperature, cut to the smallest top set reaching `top_p`, renormalised."""
    probs = torch.softmax(logits.float() / how.temperature, dim=-1)
    ranked, order = probs.sort(dim=-1, descending=True)
    keep = (ranked.cumsum(-1) - ranked) < how.top_p
    keep[..., 0] = True
    ranked = ranked * keep
    return torch.zeros_like(probs).scatter(-1, order, ranked / ranked.sum(-1, keepdim=True))


def accept_sampled(probs: torch.Tensor, drafts: Sequence[int],
                   generator: torch.Generator | None) -> list[int]:
    """Speculative sampling with point-mass drafts: `probs` (len(drafts) + 1 x vocab) are
    the target's distributions at each position. Draft t at position i is kept with
    probability p_i(t); at the first rejection the token is drawn from p_i without t,
    renormalised, and the rest dropped; with every draft kept, one more is drawn from the
    last row. The tokens produced follow p, whatever the drafts."""
    out: list[int] = []
    for i, token in enumerate(drafts):
        p = probs[i]
        if torch.rand((), generator=generator) < p[token]:
            out.append(token)
            continue
        rest = p.clone()
        rest[token] = 0
        out.append(int(torch.multinomial(rest / rest.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return out


@dataclass
class SpeculativeGeneration(Generation):
    """A generation and how its drafts fared."""

    verifications: int = 0  # verifying forwards (one-token steps where nothing was drafted)
    plain_steps: int = 0  # one-token decode steps
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens kept
    closest: float = float("inf")  # greedy: the smallest top-two logit margin a
    # verification decided a token on (what float rounding would have to move to flip it)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_verification(self) -> float:
        """Tokens a verifying forward produced, on average (kept drafts + the model's)."""
        return (self.accepted + self.verifications) / self.verifications if \
            self.verifications else 0.0


class SpeculativeDecoder:
    """Prompt-lookup speculative decoding of one prompt over `decoder`'s cache: `k` drafts
    a verification, looked up from the last `n_max`..`n_min` tokens. Its `generate` gives
    `decoder.generate`'s greedy tokens, stops and limits; `compile` compiles the verifying
    forward (shape 1 x k+1, its window dynamic) with the decoder's Inductor settings."""

    def __init__(self, decoder: StaticDecoder, k: int = 4, n_max: int = 3, n_min: int = 1):
        self.decoder, self.k, self.n_max, self.n_min = decoder, k, n_max, n_min
        self.verify: Any = verify_forward
        self.compiled = False
        register_verify_attention()

    def compile(self) -> SpeculativeDecoder:
        """Compile the verifying forward (fullgraph), where the decoder's step is compiled."""
        self.verify = torch.compile(verify_forward, fullgraph=True)
        self.compiled = True
        return self

    def _verify(self, tokens: list[int], cursor: int) -> torch.Tensor:
        """Logits (k+1 x vocab) of `tokens` written at positions cursor..cursor+k."""
        decoder = self.decoder
        window = torch.empty(cursor + len(tokens), dtype=torch.int8)
        positions = torch.arange(cursor, cursor + len(tokens))
        if self.compiled:
            # (a window of the whole cache slices nothing: a guard of its own; never asked)
            torch._dynamo.mark_dynamic(window, 0, min=len(tokens) + 1,
                                       max=decoder.max_cache_len - 1)
        # a model on the kernels decodes through the batch-invariant attention, whose
        # queries each sum over their own positions in order: a verification's query is then
        # its decode step, bit for bit, through the same attention
        verifying = (INVARIANT_ATTENTION if decoder.attention == INVARIANT_ATTENTION
                     else VERIFY_ATTENTION)
        with attention(decoder.model, verifying), \
                torch._inductor.config.patch(decoder.inductor):
            return self.verify(decoder.model, decoder.cache, torch.tensor([tokens]), positions,
                               window)

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor | Sequence[int], max_new_tokens: int,
                 stop: set[int] | None = None,
                 sampling: Sampling | None = None) -> SpeculativeGeneration:
        """Tokens after one prompt (ids, or a 1 x L tensor), at most `max_new_tokens`, ending
        at a token of `stop` (kept), as `StaticDecoder.generate` gives them (greedy: the same
        tokens; sampled: the same distribution)."""
        decoder = self.decoder
        if decoder.attention is None:
            raise ValueError("speculative decoding needs a model with SDPA or eager attention")
        ids = prompt.reshape(-1).tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        with attention(decoder.model, decoder.attention):
            return self._generate(ids, max_new_tokens, stop or set(), sampling)

    def _generate(self, ids: list[int], max_new_tokens: int, stop: set[int],
                  sampling: Sampling | None) -> SpeculativeGeneration:
        decoder, k = self.decoder, self.k
        limits, picks, generators = plan_rows(1, len(ids), max_new_tokens, [sampling],
                                              decoder.max_cache_len)
        how, generator = picks[0], generators[0]
        decoder._fresh_cache(1)
        mask = torch.ones(1, decoder.max_cache_len, dtype=torch.long) \
            if decoder.always_mask else None
        began = time.perf_counter()
        logits = decoder._forward(torch.tensor([ids]), torch.arange(len(ids)), None, mask)
        pending = [self._pick(logits, how, generator)]
        ttft = time.perf_counter() - began
        tie_graphs_to(decoder.cache)
        out = SpeculativeGeneration([], ttft, 0.0)
        history, cursor, finish = list(ids), len(ids), None
        began = time.perf_counter()
        while True:
            for token in pending:  # as StaticDecoder._record, one token at a time
                out.tokens.append(token)
                history.append(token)
                if token in stop:
                    finish = "stop"
                elif len(out.tokens) >= limits[0]:
                    finish = "length"
                if finish:
                    break
            if finish:
                break
            last = history[-1]
            cursor = len(history) - 1  # where the last token goes
            drafts = draft_tokens(history, self.n_max, self.n_min, k) \
                if limits[0] - len(out.tokens) > 1 and cursor + k + 1 < decoder.max_cache_len \
                else []
            for layer in decoder.cache.layers:
                layer.cumulative_length.fill_(cursor)
            if not drafts:
                logits = decoder.decode_step(torch.tensor([[last]]), cursor, None, mask,
                                             first=out.plain_steps == 0)
                pending = [self._pick(logits, how, generator)]
                out.plain_steps += 1
                continue
            logits = self._verify([last, *drafts], cursor)
            pending, margin = self._accept(logits, drafts, how, generator)
            out.closest = min(out.closest, margin)
            out.verifications += 1
            out.drafted += k
            out.accepted += len(pending) - 1
        spent = time.perf_counter() - began
        later = len(out.tokens) - 1
        out.decode_tokens_per_s = later / spent if spent > 0 and later else 0.0
        out.rows, out.finish = [out.tokens], [finish or "length"]
        return out

    @staticmethod
    def _pick(logits: torch.Tensor, how: Sampling | None,
              generator: torch.Generator | None) -> int:
        """The next token from one row of logits, as `pick_tokens` picks it."""
        if how is None:
            return int(logits.reshape(-1).argmax())
        probs = target_probs(logits.reshape(1, -1), how)[0]
        return int(torch.multinomial(probs, 1, generator=generator))

    @staticmethod
    def _accept(logits: torch.Tensor, drafts: list[int], how: Sampling | None,
                generator: torch.Generator | None) -> tuple[list[int], float]:
        """The tokens a verification produces (kept drafts, then the model's own) and, greedy,
        the smallest top-two margin among the positions that decided them."""
        if how is not None:
            return accept_sampled(target_probs(logits, how), drafts, generator), float("inf")
        top = logits.topk(2, dim=-1)
        best = top.indices[:, 0].tolist()
        kept = 0
        while kept < len(drafts) and drafts[kept] == best[kept]:
            kept += 1
        margins = top.values[:kept + 1, 0] - top.values[:kept + 1, 1]
        return [*drafts[:kept], best[kept]], float(margins.min())

"""What is measured of a causal LM: generation speed (time to first token, decode tokens/s
at batch 1 and N over a static KV cache, Hugging Face `generate` as the naive reference),
peak memory, and agreement with the float model's greedy tokens."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from compress.families.causal_lm.model import StaticDecoder, greedy_agreement
from compress.measure.memory import peak_rss_mb, reset_peak_rss  # noqa: F401  (measured here)
from serve.causal_lm.runtime.loading import prompt_ids as runtime_prompt_ids


def prompt_ids(tokenizer, prompt: Any, chat_template: bool) -> torch.Tensor:
    """1 x L token ids of a prompt (a string or chat messages), through the tokenizer's chat
    template when asked and it has one (the runtime's encoding, as a tensor)."""
    return torch.tensor([runtime_prompt_ids(tokenizer, prompt, chat_template)])


def decoder_for(bundle, cache_len: int, mode: str) -> StaticDecoder:
    """A static-cache decoder of the bundle's model, compiled unless `mode` is none."""
    decoder = StaticDecoder(bundle.model, cache_len)
    return decoder.compile(mode) if mode != "none" else decoder


def time_generation(bundle, prompts: list[torch.Tensor], gen) -> dict[str, Any]:
    """Greedy tokens of every prompt with time to first token and decode tokens/s at
    batch 1 (medians over prompts), then decode tokens/s at each larger batch size
    (copies of the first prompt), and the peak resident memory while generating."""
    mode = (bundle.causal_lm_facts or {}).get("compile") or gen.compile
    reset_peak_rss()
    decoder = decoder_for(bundle, gen.cache_len, mode)
    began = time.perf_counter()
    decoder.generate(prompts[0], gen.max_new_tokens)  # compiles the decode step
    first_call = time.perf_counter() - began
    runs = [decoder.generate(ids, gen.max_new_tokens) for ids in prompts]
    out: dict[str, Any] = {
        "decode_tok_s_b1": round(statistics.median(r.decode_tokens_per_s for r in runs), 2),
        "ttft_ms": round(1000 * statistics.median(r.ttft_s for r in runs), 2),
        "prompt_tokens": round(statistics.median(ids.shape[1] for ids in prompts), 1),
        "decode_compile": mode, "first_generate_s": round(first_call, 2),
        "tokens": [r.tokens for r in runs],
    }
    for batch in (b for b in gen.batch_sizes if b > 1):
        wide = decoder_for(bundle, gen.cache_len, mode)
        rows = prompts[0].expand(batch, -1)
        wide.generate(rows, gen.max_new_tokens)
        out[f"decode_tok_s_b{batch}"] = round(
            wide.generate(rows, gen.max_new_tokens).decode_tokens_per_s, 2)
    out["peak_rss_mb"] = peak_rss_mb()
    return out


@torch.inference_mode()
def eager_generate_rate(model: nn.Module, prompts: list[torch.Tensor],
                        max_new_tokens: int, rounds: int = 2) -> float | None:
    """Decode tokens/s of Hugging Face `generate` (eager, dynamic cache, greedy) at batch 1:
    (N - 1) tokens over the time of N tokens less the time of one (the prefill), median over
    prompts. Each length is timed `rounds` times, alternating, after one untimed call, and
    the fastest kept, so a pause in one call cannot make the difference negative; None if it
    is still not positive (a machine too noisy to tell)."""
    def timed(ids: torch.Tensor, n: int) -> float:
        began = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False)
        return time.perf_counter() - began

    if max_new_tokens < 2 or not prompts:
        return None
    timed(prompts[0], 1)  # warm-up: first-call allocations and lazy initialization
    rates = []
    for ids in prompts:
        best = {1: float("inf"), max_new_tokens: float("inf")}
        for _ in range(rounds):
            for n in best:
                best[n] = min(best[n], timed(ids, n))
        decode_s = best[max_new_tokens] - best[1]
        if decode_s > 0:
            rates.append((max_new_tokens - 1) / decode_s)
    return round(statistics.median(rates), 2) if rates else None


DECISIVE_MARGIN = 0.5  # logits between the float model's first and second choice


@torch.inference_mode()
def forced_logits(model: nn.Module, ids: torch.Tensor, reference: list[int]) -> torch.Tensor:
    """len(reference) x vocabulary float32 logits of the next token at each reference step,
    given the prompt and the reference's tokens so far (teacher forcing)."""
    full = torch.cat([ids, torch.tensor([reference])], dim=1)
    return model(input_ids=full).logits[0, ids.shape[1] - 1:-1].float()


def reference_margins(model: nn.Module, prompts: list[torch.Tensor],
                      reference: list[list[int]]) -> list[list[float]]:
    """At every step of the reference's greedy tokens, how far its first choice led its
    second (logits): small margins are near-ties, where any rounding may flip the choice."""
    margins = []
    for ids, ref in zip(prompts, reference, strict=True):
        if not ref:
            margins.append([])
            continue
        top = forced_logits(model, ids, ref).topk(2, dim=-1).values
        margins.append([round(float(m), 4) for m in top[:, 0] - top[:, 1]])
    return margins


def next_token_matches(model: nn.Module, prompts: list[torch.Tensor],
                       reference: list[list[int]]) -> list[list[bool]]:
    """Per reference step: is the model's next-token choice, given the prompt and the
    reference's greedy tokens so far (teacher forcing), the reference's token?"""
    return [(forced_logits(model, ids, ref).argmax(-1) == torch.tensor(ref)).tolist()
            if ref else [] for ids, ref in zip(prompts, reference, strict=True)]


def agreement(model: nn.Module, prompts: list[torch.Tensor], tokens: list[list[int]],
              reference: list[list[int]], margins: list[list[float]] | None = None
              ) -> dict[str, Any]:
    """Free-running greedy agreement (positions up to each pair's shorter length; one early
    difference changes everything after it) and teacher-forced next-token agreement. With
    the reference's `margins`: the median margin where each differing prompt first left the
    reference, and teacher-forced agreement on the decisive steps (margin at least
    `DECISIVE_MARGIN`), which tell rounding that flips near-ties from real damage."""
    matches = next_token_matches(model, prompts, reference)
    flat = [m for row in matches for m in row]
    out: dict[str, Any] = {
        "agreement": round(greedy_agreement(reference, tokens), 4),
        "next_token_agreement": round(sum(flat) / len(flat), 4) if flat else 1.0}
    if margins:
        firsts = [row[k] for ref, got, row in zip(reference, tokens, margins, strict=True)
                  if (k := first_difference(ref, got)) is not None and k < len(row)]
        decisive = [m for row, ms in zip(matches, margins, strict=True)
                    for m, margin in zip(row, ms, strict=True) if margin >= DECISIVE_MARGIN]
        out["divergence_margin_median"] = (round(statistics.median(firsts), 4)
                                           if firsts else None)
        out["next_token_agreement_decisive"] = (round(sum(decisive) / len(decisive), 4)
                                                if decisive else 1.0)
    return out


def first_difference(reference: list[int], candidate: list[int]) -> int | None:
    """The first step where two generations differ (None: equal up to the shorter)."""
    pairs = enumerate(zip(reference, candidate, strict=False))
    return next((k for k, (a, b) in pairs if a != b), None)

"""A causal LM exported for ExecuTorch (stage `export` with `format: executorch`): one
`model.pte` for phones and edge CPUs (export.executorch.decoder), its linear layers on
XNNPACK's dynamic-activation schemes (`quantize: 8da4w` or `8da8w`; none: float32), and the
file held against the model that entered the stage, run by `executorch.runtime` here.

Parity: the recipe's prompts (through the chat template when the recipe asks) decoded
greedily by the file, one token a call over its own KV cache, and by the model (its static
cache decoder at batch 1), `max_new_tokens` each with no stop token: the share of equal
tokens (`executorch_token_agreement`; below `min_agreement`, when the recipe sets it, the
stage fails). Then the first `PARITY_TEXTS` eval texts scored by both, the same token ids:
perplexity of each and its change, and on the first `LOGIT_POSITIONS` positions the largest
logit difference and the top-1 agreement. An 8da scheme rounds activations to int8 at each
call and weights again on its own grid (a grouped model's too: compress's grouped operators
cannot be lowered to XNNPACK), so the tokens agree rather than equal; the figures say how
far.

The stage's figures of record are the file's too, as the family measures a model
(`file_figures`): perplexity on the whole eval split, agreement with the run's float
reference tokens (free-running and teacher-forced), and with latency on, time to first token
and decode tokens/s at batch 1 in executorch.runtime; the family then decodes nothing again.
The model goes on unchanged.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any

import numpy as np
import torch

from compress.errors import ParityError
from compress.families.causal_lm.family import reference_file
from compress.families.causal_lm.generation import agreement, first_difference
from compress.families.causal_lm.model import (
    greedy_agreement,
    perplexity,
    scored_sequences,
    sequence_scores,
)
from compress.recipe.kinds.export import EXECUTORCH_FORMAT, ExportConfig
from compress.runfolder.records import artifact_record
from compress.stages.context import StageContext, State
from export.executorch.decoder import PteCausalLM, export_causal_lm
from serve.causal_lm.runtime import StaticDecoder, prompt_ids

PARITY_TEXTS = 16  # eval texts the file and the model both score
LOGIT_POSITIONS = 100


def file_tokens(pte: PteCausalLM, prompts: list[list[int]], max_new_tokens: int
                ) -> tuple[list[list[int]], dict[str, float]]:
    """The file's greedy tokens after each prompt, and its median time to first token (ms)
    and decode tokens/s (the tokens after the first over their time) at batch 1."""
    tokens, ttft, rates = [], [], []
    for ids in prompts:
        began = time.perf_counter()
        first = int(pte.forward(ids)[-1].argmax())
        ttft.append(time.perf_counter() - began)
        began = time.perf_counter()
        tokens.append([first] + pte.generate_after(ids, first, max_new_tokens - 1))
        rates.append((max_new_tokens - 1) / (time.perf_counter() - began))
    return tokens, {"ttft_ms": round(1000 * statistics.median(ttft), 2),
                    "decode_tok_s_b1": round(statistics.median(rates), 2)}


def token_parity(model: Any, prompts: list[list[int]], got: list[list[int]],
                 max_new_tokens: int, cache_len: int) -> dict[str, Any]:
    """The file's greedy tokens against the model's on the same prompt ids."""
    decoder = StaticDecoder(model, cache_len)
    want = [decoder.generate([ids], max_new_tokens).rows[0] for ids in prompts]
    first = next(((i, k) for i, (a, b) in enumerate(zip(want, got, strict=True))
                  if (k := first_difference(a, b)) is not None), None)
    return {"executorch_token_agreement": round(greedy_agreement(want, got), 6),
            "executorch_prompts": len(prompts), "executorch_new_tokens": max_new_tokens,
            "executorch_first_difference": None if first is None else
            {"prompt": first[0], "position": first[1],
             "source_token": want[first[0]][first[1]], "exported_token": got[first[0]][first[1]]}}


def score_parity(model: Any, pte: PteCausalLM, sequences: list[list[int]]) -> dict[str, Any]:
    """Perplexity of the file and of the model on the same sequences, and their logits on
    the first LOGIT_POSITIONS positions."""
    ours, our_nll = sequence_scores(model, sequences, LOGIT_POSITIONS)
    theirs, their_nll = sequence_scores(pte, sequences, LOGIT_POSITIONS)
    tokens = sum(len(s) - 1 for s in sequences)
    our_ppl, their_ppl = math.exp(sum(our_nll) / tokens), math.exp(sum(their_nll) / tokens)
    return {"executorch_perplexity": round(their_ppl, 4),
            "executorch_source_perplexity": round(our_ppl, 4),
            "executorch_perplexity_change_pct": round(100 * (their_ppl / our_ppl - 1), 4),
            "executorch_parity_texts": len(sequences), "executorch_parity_tokens": tokens,
            "executorch_logit_positions": len(ours),
            "executorch_logit_max_abs_diff": round(float(np.abs(ours - theirs).max()), 6),
            "executorch_top1_agreement": round(float((ours.argmax(-1) == theirs.argmax(-1))
                                                     .mean()), 6)}


def file_figures(pte: PteCausalLM, tokenizer: Any, ctx: StageContext,
                 prompts: list[list[int]], tokens: list[list[int]]) -> dict[str, Any]:
    """The family's figures of the file (`family.measure`'s keys): perplexity on the eval
    split, and agreement with the run's reference tokens where the run has them."""
    figures = perplexity(pte, tokenizer, ctx.data.splits["eval"].texts, ctx.data.max_length,
                         batch_size=1)
    ref_file = reference_file(ctx.run_dir)
    if ref_file.is_file():
        ref = json.loads(ref_file.read_text())
        rows = len(tokens)  # the prompts compared (parity_samples): the reference's first
        margins = ref.get("margins")
        figures.update(agreement(pte, [torch.tensor([ids]) for ids in prompts], tokens,
                                 ref["tokens"][:rows], margins[:rows] if margins else None))
        figures["perplexity_delta_vs_float_pct"] = round(
            100 * (figures["perplexity"] / ref["perplexity"] - 1), 3)
    return figures


def run(state: State, cfg: ExportConfig, ctx: StageContext) -> State:
    """Write the `.pte` of the model that entered the stage, run it in ExecuTorch against
    the model, record it; the model goes on unchanged."""
    bundle = state.bundle
    model, tokenizer = bundle.model.eval(), bundle.tokenizer
    gen = ctx.recipe.evaluation.generation
    prompts = ctx.data.prompts[:cfg.parity_samples] if cfg.parity_samples else ctx.data.prompts
    ids = [prompt_ids(tokenizer, p, ctx.recipe.data.chat_template) for p in prompts]
    sequences = scored_sequences(tokenizer, ctx.data.splits["eval"].texts[:PARITY_TEXTS],
                                 ctx.data.max_length)
    cache_len = max(gen.cache_len, max(map(len, ids)) + gen.max_new_tokens,
                    max(map(len, sequences)), ctx.data.max_length)
    final = ctx.folder / EXECUTORCH_FORMAT

    def log(message: str) -> None:
        ctx.log(f"{ctx.name}: {message}")

    began = time.perf_counter()
    path, facts = export_causal_lm(model, tokenizer, final, cfg.quantize, cache_len, log)
    ctx.metrics.update(facts, export_s=round(time.perf_counter() - began, 1),
                       runtime=EXECUTORCH_FORMAT)
    began = time.perf_counter()
    pte = PteCausalLM(final)
    ctx.metrics["executorch_load_s"] = round(time.perf_counter() - began, 2)
    log(f"parity: the file and the model decode {len(ids)} prompts x {gen.max_new_tokens} "
        f"tokens and score {len(sequences)} eval texts")
    tokens, speed = file_tokens(pte, ids, gen.max_new_tokens)
    figures = token_parity(model, ids, tokens, gen.max_new_tokens, cache_len)
    figures.update(score_parity(model, pte, sequences))
    (final / "parity.json").write_text(json.dumps(figures, indent=2))
    ctx.metrics.update(figures, executorch_min_agreement=cfg.min_agreement)
    log(f"greedy agreement {figures['executorch_token_agreement']}, perplexity "
        f"{figures['executorch_perplexity']} against the model's "
        f"{figures['executorch_source_perplexity']} "
        f"({figures['executorch_perplexity_change_pct']:+.2f}%)")
    where = final.relative_to(ctx.run_dir)
    if cfg.min_agreement and figures["executorch_token_agreement"] < cfg.min_agreement:
        diff = figures["executorch_first_difference"]
        raise ParityError(f"{where}: greedy token agreement "
                          f"{figures['executorch_token_agreement']} < {cfg.min_agreement} "
                          f"(first difference: prompt {diff['prompt']}, token "
                          f"{diff['position']}); parity.json has the figures")
    ctx.metrics.update(file_figures(pte, tokenizer, ctx, ids, tokens),
                       **{f"executorch_{key}": value for key, value in speed.items()})
    if ctx.recipe.evaluation.latency.enabled:  # the file's, under the family's names
        ctx.metrics.update(speed, prompt_tokens=round(statistics.median(map(len, ids)), 1))
    ctx.add_output(artifact_record(path, ctx.run_dir, EXECUTORCH_FORMAT, export_dir=str(where)))
    return State(bundle)

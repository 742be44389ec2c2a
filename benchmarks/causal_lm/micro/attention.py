"""What batch invariance costs in the attention: SmolLM2-135M (int8_grouped by default) decoding
through the kernels' `cache_attention` (every row's sums over its own positions, in order:
`attention.py`'s `invariant_attention`, what a model on the kernels runs) against the torch
decode attention it replaced (`decode_attention`: one vectorized softmax over the whole
window), eager and compiled, at 1 and 8 rows, rounds alternating in one process. Also the
time to first token of a 128-token prompt and of a `--long-prompt` one (1,000 tokens; eager
prefills, where the torch path's prefill runs SDPA's flash attention).

    python -m benchmarks.causal_lm.micro.attention                  # 3 rounds
    python -m benchmarks.causal_lm.micro.attention --compile none --rounds 5
    python -m benchmarks.causal_lm.micro.attention --markdown benchmarks/results/llm_attention.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.causal_lm.inputs import MODEL, PROMPTS, prompt_ids, sentences
from benchmarks.harness.provenance import header_text, shown
from compress.families.causal_lm.model import StaticDecoder, load_causal_lm, quantize_weights
from serve.causal_lm.runtime.attention import DECODE_ATTENTION, INVARIANT_ATTENTION

CACHE_LEN = 512
KINDS = {"invariant": INVARIANT_ATTENTION, "torch": DECODE_ATTENTION}


def decoder_for(model: torch.nn.Module, kind: str, compile_mode: str,
                cache_len: int = CACHE_LEN) -> StaticDecoder:
    decoder = StaticDecoder(model, max(cache_len, CACHE_LEN), always_mask=True)
    decoder.attention = KINDS[kind]  # what decode_attention_for chose, overridden
    return decoder.compile(compile_mode) if compile_mode != "none" else decoder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default="int8_grouped")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per timing")
    parser.add_argument("--compile", default="default", help="torch.compile mode, or none")
    parser.add_argument("--markdown", type=Path, help="also write the printed table there")
    parser.add_argument("--long-prompt", type=int, default=1000,
                        help="tokens of the long prompt's TTFT (0: none)")
    args = parser.parse_args(argv)
    lm = load_causal_lm(args.model)
    quantize_weights(lm.model, args.scheme)
    prompts = [prompt_ids(lm.tokenizer, text)[0].tolist() for text in PROMPTS[:8]]
    long_prompt = lm.tokenizer(" ".join(sentences(40)))["input_ids"][:128]
    longer = lm.tokenizer(" ".join(sentences(400)))["input_ids"][:args.long_prompt]
    eager_long = {kind: decoder_for(lm.model, kind, "none", len(longer) + 8) for kind in KINDS}
    cells = [(kind, rows) for kind in KINDS for rows in (1, 8)]
    made = {cell: decoder_for(lm.model, cell[0], args.compile) for cell in cells}
    for (_, rows), decoder in made.items():  # warm up (compiles)
        decoder.generate(prompts[:rows], 4)
    step_ms: dict[tuple[str, int], list[float]] = {cell: [] for cell in cells}
    ttft_ms: dict[str, list[float]] = {kind: [] for kind in KINDS}
    long_ms: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for r in range(args.rounds):
        for cell in cells if r % 2 == 0 else cells[::-1]:
            out = made[cell].generate(prompts[:cell[1]], args.tokens)
            step_ms[cell].append(1000 * cell[1] / out.decode_tokens_per_s)
        for kind in KINDS if r % 2 == 0 else list(KINDS)[::-1]:
            decoder = made[(kind, 1)]
            began = time.perf_counter()
            decoder.generate([long_prompt], 1)
            ttft_ms[kind].append(1000 * (time.perf_counter() - began))
            if args.long_prompt:
                began = time.perf_counter()
                eager_long[kind].generate([longer], 1)
                long_ms[kind].append(1000 * (time.perf_counter() - began))
    lines: list[str] = []
    lines.append(header_text("benchmarks.causal_lm.micro.attention", argv))
    lines.append(f"{shown(args.model)} {args.scheme}, {args.tokens} new tokens a timing, compile "
          f"{args.compile}, {torch.get_num_threads()} threads, {args.rounds} rounds "
          "(median, min-max)")
    lines.append(f"{'attention':<11}{'rows':>5}{'ms/step':>9}{'spread':>15}{'tok/s':>8}"
                 f"{'x torch':>9}")
    for kind, rows in cells:
        times = step_ms[(kind, rows)]
        median, torch_median = statistics.median(times), statistics.median(
            step_ms[("torch", rows)])
        lines.append(f"{kind:<11}{rows:>5}{median:>9.2f}"
                     f"{f'{min(times):.2f}-{max(times):.2f}':>15}{1000 * rows / median:>8.1f}"
                     f"{torch_median / median:>9.2f}")
    for kind, times in ttft_ms.items():
        lines.append(f"TTFT {len(long_prompt)}-token prompt, {kind}: "
                     f"{statistics.median(times):.1f} ms ({min(times):.1f}-{max(times):.1f})")
    for kind, times in long_ms.items():
        if times:
            lines.append(f"TTFT {len(longer)}-token prompt, {kind}: "
                         f"{statistics.median(times):.1f} ms ({min(times):.1f}-{max(times):.1f})")
    lines.append("ms/step: a decode step's time (all its rows); x torch: the torch attention's "
                 "time over this one's (above 1: faster)")
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("# The attention's cost of batch invariance\n\n```\n"
                                 + "\n".join(lines) + "\n```\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

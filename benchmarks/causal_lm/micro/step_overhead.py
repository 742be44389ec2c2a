"""Where a decode step's time goes outside the weight products: SmolLM2-135M int8_grouped
(or int4_grouped) at batch 1 through each way compress drives the step (torch.compile's
Python wrapper, its C++ wrapper with guards checked once a generation, the AOTInductor
package an archive serves), alternating rounds in one process. Per step: the wall time,
the time of its grouped products alone (`products_ms`: the same kernel calls back to back,
no graph), and the rest: norms, RoPE, attention, sampling and the framework between kernels;
and `in step ms`, the kernel operators' own time inside each driven step (torch.profiler).

    python -m benchmarks.causal_lm.micro.step_overhead           # int8_grouped, 3 rounds
    python -m benchmarks.causal_lm.micro.step_overhead --scheme int4_grouped --rounds 5
    python -m benchmarks.causal_lm.micro.step_overhead --scheme int8_sparse24 \
        --model runs/llm_sparse24/00-prune/model   # a 2:4-pruned folder (llm_sparse24.yaml)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.causal_lm.inputs import MODEL, PROMPTS, prompt_ids
from benchmarks.harness.provenance import header_text, shown
from compress.families.causal_lm.model import (
    StaticDecoder,
    load_causal_lm,
    quantize_weights,
)
from serve.causal_lm.runtime.sparse24 import SCHEMES
from serve.causal_lm.server import aot_steps

CACHE_LEN = 512
# the kernels' library's operators that are not products (batch-invariant attention)
ATTENTION_OPS = ("compress_lm::cache_attention",)


def decoders(model: torch.nn.Module, folder: Path) -> dict[str, StaticDecoder]:
    """The three ways to drive the step, each warmed up (compiled or exported)."""
    made = {"python": StaticDecoder(model, CACHE_LEN).compile("max-autotune"),
            "cpp": StaticDecoder(model, CACHE_LEN).compile("max-autotune", cpp_wrapper=True,
                                                           skip_guards=True)}
    aot_steps.export_steps(model, 1, CACHE_LEN, "max-autotune", folder)
    made["aoti"] = aot_steps.use_step(StaticDecoder(model, CACHE_LEN, always_mask=True),
                                      aot_steps.load_steps(folder, model)[1])
    return made


def products_ms(model: torch.nn.Module, repeats: int = 30) -> float:
    """Milliseconds of a step's grouped products alone: each kernel call of one decode step
    (every module with kernel records, the input table aside) on one row, back to back in a
    Python loop, no graph around them; the median of `repeats` passes (a pass streams
    ~150 MB, past any cache)."""
    table = {id(m) for m in model.get_input_embeddings().modules()}
    kernels = [m for m in model.modules()
               if getattr(m, "packed", None) is not None and id(m) not in table]
    calls = [(m.product, torch.randn(1, m.in_features), m.packed, m.out_features)
             for m in kernels]  # GroupedLinear, Sparse24Linear or their ProjectionGroup
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        for product, *arguments in calls:
            product(*arguments)
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def products_in_step_ms(decoder: StaticDecoder, ids: list[int], tokens: int) -> float:
    """Milliseconds a decode step of the kernel operators' own time inside the driven step:
    torch.profiler's self CPU time of every `compress_lm::` operator over a generation of
    `tokens` less that over a generation of 1 (the prefill), over the `tokens - 1` steps
    (the library's attention, `ATTENTION_OPS`, left out).
    The products as the step runs them, where `products_ms` runs them alone."""
    from torch.profiler import ProfilerActivity, profile

    def kernels_us(count: int) -> float:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decoder.generate([ids], count)
        return sum(e.self_cpu_time_total for e in prof.key_averages()
                   if e.key.startswith("compress_lm::") and e.key not in ATTENTION_OPS)

    return (kernels_us(tokens) - kernels_us(1)) / 1000 / (tokens - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", choices=("int8_grouped", "int4_grouped", *SCHEMES),
                        default="int8_grouped", help="the 2:4 schemes need --model 2:4-pruned")
    parser.add_argument("--model", default=MODEL,
                        help="a GGUF or a float folder (default: the shipped SmolLM2 GGUF)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    lm = load_causal_lm(args.model)
    quantize_weights(lm.model, args.scheme)
    ids = prompt_ids(lm.tokenizer, PROMPTS[0])[0].tolist()
    with tempfile.TemporaryDirectory() as tmp:
        made = decoders(lm.model, Path(tmp))
        for decoder in made.values():
            decoder.generate([ids], 4)
        steps: dict[str, list[float]] = {name: [] for name in made}
        for r in range(args.rounds):
            for name in made if r % 2 == 0 else list(made)[::-1]:
                out = made[name].generate([ids], args.tokens)
                steps[name].append(1000 / out.decode_tokens_per_s)
        in_step = {name: products_in_step_ms(decoder, ids, args.tokens)
                   for name, decoder in made.items()}
    inside = products_ms(lm.model)
    print(header_text("benchmarks.causal_lm.micro.step_overhead", argv))
    print(f"{shown(args.model)} {args.scheme}, batch 1, {args.tokens} tokens, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds (median, min-max)")
    print(f"{'step':<8}{'ms/token':>10}{'spread':>16}{'products ms':>13}{'rest ms':>9}"
          f"{'in step ms':>12}{'tok/s':>8}")
    for name, times in steps.items():
        median = statistics.median(times)
        print(f"{name:<8}{median:>10.2f}{f'{min(times):.2f}-{max(times):.2f}':>16}"
              f"{inside:>13.2f}{median - inside:>9.2f}{in_step[name]:>12.2f}"
              f"{1000 / median:>8.1f}")
    print("products ms: the step's kernel calls alone, back to back from Python; in step ms: "
          "the same operators' own time a decode step inside the driven step "
          "(torch.profiler, the prefill's taken out)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One fresh process of benchmarks/causal_lm/peers.py on AMD zentorch's side, run by the
zentorch environment's Python (torch, zentorch, transformers, gguf; no compress: the standard
library and the harness's child_main and machine besides): `python -m
benchmarks.causal_lm.zentorch_child SPEC_JSON` prints one JSON line (the figures, or
{"error": one line}).

Modes:
- "measure": SmolLM2 loaded by transformers from the GGUF (dequantized to float32, as
  compress loads it; cast to bfloat16 for "bf16"), its forward compiled with
  `torch.compile(backend="zentorch")` (zentorch's documented path for Hugging Face models;
  `zentorch.llm.optimize` is deprecated in these releases) with Inductor's freezing, Hugging
  Face `generate` on a static KV cache made once a batch size (fixed decode shapes):
  perplexity, greedy tokens and the compiled logits' largest difference from eager ones
  (when asked), greedy decode tok/s at batch 1 and 8 (left-padded rows, EOS ignored), the
  time to the first token of the long prompt, and weight bytes a step reads.
- "facts": versions, zentorch's build config and whether this CPU runs bf16 natively.

Freezing is not only speed: without it (zentorch 2.13.0.2, ZenDNNL 6.1.0, this Zen 4) the
matmul weight cache, keyed by address, gives wrong products once an address holds another
tensor (`zentorch_mm(a, w.t())` after a freed matrix of the same shape: off by ~100; the
compiled model: perplexity 49021 instead of 343 on 8 SST-2 sentences).
`ZENDNNL_MATMUL_WEIGHT_CACHE=0` is right too, and 4x slower. Frozen weights are constants
at fixed addresses: the logits match eager's to 1e-4 (`max_logit_diff` checks each run).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.child_main import run_modes
from benchmarks.harness.machine import cpu_flags

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
SETTINGS = {"ZENDNNL_MATMUL_ALGO": "1",  # AMD's setting for LLM (and NLP latency) models
            "TORCHINDUCTOR_FREEZING": "1"}  # weights as constants (see the docstring)


def weight_bytes_per_token(model: Any) -> int:
    """Weight bytes one decode step reads: each parameter once (a tied one once), the
    input embedding a row unless it is the output projection too."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    seen, total = set(), 0
    for parameter in model.parameters():
        if parameter.data_ptr() in seen:
            continue
        seen.add(parameter.data_ptr())
        size = parameter.numel() * parameter.element_size()
        total += size // embed.shape[0] if parameter is embed and not tied else size
    return total


class Runner:
    """A compiled model and one static KV cache a batch size, reused by every generate."""

    def __init__(self, model: Any, max_cache_len: int, pad: int):
        self.model, self.max_cache_len, self.pad, self.caches = model, max_cache_len, pad, {}

    def cache(self, batch: int) -> Any:
        from transformers import StaticCache

        if batch not in self.caches:
            self.caches[batch] = StaticCache(config=self.model.config,
                                             max_cache_len=self.max_cache_len)
        cache = self.caches[batch]
        cache.reset()
        return cache

    def generate(self, prompts: list[list[int]], new: int) -> tuple[list[list[int]], float,
                                                                    float]:
        """Greedy tokens of each prompt (left-padded, no EOS stop), the seconds to the first
        tokens and the tokens per second after them (every row counted)."""
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        stamps: list[float] = []

        class Stamp(LogitsProcessor):
            def __call__(self, input_ids: Any, scores: Any) -> Any:
                stamps.append(time.perf_counter())
                return scores

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        cache = self.cache(len(prompts))
        began = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=mask, cache=cache,
                                  max_new_tokens=new, do_sample=False,
                                  logits_processor=LogitsProcessorList([Stamp()]),
                                  pad_token_id=self.pad, eos_token_id=None)
        rows = [[int(t) for t in row[width:]] for row in out]
        ttft = stamps[0] - began
        rate = len(prompts) * (new - 1) / (stamps[-1] - stamps[0]) if new > 1 else 0.0
        return rows, ttft, rate


def load(path: str, dtype: str, threads: int) -> Any:
    """The GGUF's model through transformers, eval, in `dtype`, forward compiled by
    zentorch (`torch.compile(model.forward, backend="zentorch")`)."""
    import torch
    import zentorch  # noqa: F401 - registers the "zentorch" backend
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    torch._dynamo.config.cache_size_limit = 64  # prompt lengths, batch sizes, no cache
    gguf = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    model = model.eval().to(getattr(torch, DTYPES[dtype]))
    model.generation_config.disable_compile = True  # ours is zentorch's, not generate's
    model.generation_config.eos_token_id = None
    model.eager_forward = model.forward
    model.forward = torch.compile(model.forward, backend="zentorch")
    return model


def logit_diff(model: Any, ids: list[int]) -> float:
    """The largest |compiled - eager| logit on `ids` (the same dtype, no cache)."""
    import torch

    tensor = torch.tensor([ids])
    eager = model.eager_forward(input_ids=tensor, use_cache=False).logits.float()
    return float((model(input_ids=tensor, use_cache=False).logits.float() - eager).abs().max())


def perplexity(model: Any, text_ids: list[list[int]]) -> dict[str, Any]:
    """exp(summed next-token NLL / predicted tokens), a text at a time (no padding)."""
    import torch

    total, count = 0.0, 0
    for ids in text_ids:
        if len(ids) < 2:
            continue
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]),
                                                         reduction="sum"))
        count += len(ids) - 1
    return {"perplexity": round(float(torch.tensor(total / max(count, 1)).exp()), 4),
            "eval_tokens": count}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Load, compile and measure one dtype (see the module's docstring)."""
    for name, value in SETTINGS.items():
        os.environ.setdefault(name, value)
    import torch

    if spec.get("dtype", "fp32") not in DTYPES:
        raise ValueError(f"unknown dtype {spec.get('dtype')!r} (known: {', '.join(DTYPES)})")
    inputs = json.loads(Path(spec["inputs"]).read_text())
    threads, tokens, repeats = spec.get("threads") or os.cpu_count() or 1, spec["tokens"], \
        spec.get("repeats", 3)
    began = time.perf_counter()
    model = load(spec["model"], spec.get("dtype", "fp32"), threads)
    figures: dict[str, Any] = {"load_s": round(time.perf_counter() - began, 3),
                               "bytes_per_token": weight_bytes_per_token(model),
                               "threads": torch.get_num_threads()}
    prompts, long = inputs["prompts"], inputs["ttft_prompt"]
    longest = max(len(p) for p in [*prompts, long]) + max(tokens, spec["greedy_tokens"])
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    runner = Runner(model, max(512, longest + 8), pad)
    with torch.no_grad():
        if spec.get("quality"):
            figures["max_logit_diff"] = logit_diff(model, inputs["text_ids"][0])
            figures.update(perplexity(model, inputs["text_ids"]))
            figures["greedy"] = [runner.generate([p], spec["greedy_tokens"])[0][0]
                                 for p in prompts]
        runner.generate([prompts[0]], 4)  # warm-up (the compiles, when not done above)
        figures["tok_s_b1"] = statistics.median(runner.generate([prompts[0]], tokens)[2]
                                                for _ in range(repeats))
        runner.generate([long], 1)  # its prefill's shape, compiled outside the timing
        figures["ttft_ms"] = 1000 * statistics.median(runner.generate([long], 1)[1]
                                                      for _ in range(repeats))
        batch = prompts[:spec.get("batch", 8)]
        runner.generate(batch, 4)  # warm-up
        runs = [runner.generate(batch, tokens) for _ in range(repeats)]
        figures["tok_s_b8"] = statistics.median(r[2] for r in runs)
        if spec.get("quality"):  # checked against batch 1's greedy tokens by the parent
            figures["b8_rows"] = runs[0][0]
    return {**figures, "dtype": spec.get("dtype", "fp32"), "pid": os.getpid()}


def facts(spec: dict[str, Any]) -> dict[str, Any]:
    """Versions, zentorch's build config (its first lines) and native bf16 support."""
    import importlib.metadata as metadata

    import torch
    import zentorch

    flags = cpu_flags()
    config = " ".join(str(zentorch.__config__).split())[:300]
    return {"zentorch": zentorch.__version__, "torch": torch.__version__,
            **{name: metadata.version(name) for name in ("transformers", "gguf")},
            "stable_abi_only": bool(getattr(zentorch, "__stable_abi_only__", False)),
            "bf16": bool({"avx512_bf16", "amx_bf16"} & flags), "config": config}


MODES = {"measure": measure, "facts": facts}


def main(argv: list[str] | None = None) -> int:
    """The spec's mode, its JSON line on stdout (`child_main.run_modes`)."""
    return run_modes(MODES, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())

"""Stage `compile` on a causal LM: the decode step over a static KV cache through
torch.compile (fullgraph, Inductor freezing, max-autotune's C++ GEMM templates when asked).
The mode is saved with the model, so what measures, exports and serves it compiles it alike.
"""

from __future__ import annotations

import time

import torch

from compress.families.causal_lm.generation import decoder_for, prompt_ids
from compress.models.bundle import ModelBundle
from compress.recipe.kinds.compile import CompileConfig
from compress.stages.context import StageContext, State


def decode_mode(cfg: CompileConfig) -> str:
    """The decode step's compile mode (CUDA graphs do not apply on a CPU)."""
    return "max-autotune" if cfg.mode.startswith("max-autotune") else "default"


def run(state: State, cfg: CompileConfig, ctx: StageContext) -> State:
    """Compile the decode step once to time it (compile_s), save the model with the mode."""
    source = state.bundle
    mode = decode_mode(cfg)
    bundle = ModelBundle(source.model, "causal-lm", [], tokenizer=source.tokenizer,
                         causal_lm_facts={**(source.causal_lm_facts or {}), "compile": mode})
    prompt = ctx.data.prompts[0] if ctx.data.prompts else ctx.data.splits["eval"].texts[0]
    ids = prompt_ids(source.tokenizer, prompt, ctx.recipe.data.chat_template)
    decoder = decoder_for(bundle, ctx.recipe.evaluation.generation.cache_len, mode)
    began = time.perf_counter()
    with torch.inference_mode():
        decoder.generate(ids, 2)
    ctx.metrics.update({"compile_s": round(time.perf_counter() - began, 2),
                        "decode_compile": mode})
    ctx.save_model(bundle)
    return State(bundle)

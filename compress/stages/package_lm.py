"""Stage `package` on a causal LM: a TorchServe `.mar` of a `format: transformers` export
with the streaming generation handler (`serve/lm_handler.py`, with `lm_requests.py` and
`lm_replies.py`; the export folder already holds `lm_runtime.py`), ready for `compress serve`."""

from __future__ import annotations

import json
from pathlib import Path

from compress.recipe.kinds.package import PackageConfig, lm_new_tokens
from compress.serving.archive import HANDLER
from compress.stages.context import StageContext, State
from compress.stages.package import archive
from serve.worker_threads import worker_threads

LM_HANDLER = HANDLER.with_name("lm_handler.py")  # imports TorchServe: not imported here
LM_MODULES = tuple(HANDLER.with_name(f"{name}.py")
                   for name in ("lm_requests", "lm_replies", "lm_openai", "lm_batcher"))
DEFAULT_NEW_TOKENS = 64
LM_SERVED_METRICS = ("perplexity", "perplexity_delta_vs_float_pct", "agreement",
                     "next_token_agreement", "decode_tok_s_b1", "ttft_ms",
                     "parity_token_agreement", "scheme", "runtime_threads")


def handler_settings(cfg: PackageConfig, ctx: StageContext, export_dir: Path) -> dict:
    """model-config.yaml's `handler:` section for the generation handler."""
    facts = json.loads((export_dir / "causal_lm.json").read_text())
    cache_len = cfg.cache_len or ctx.recipe.evaluation.generation.cache_len
    limit = lm_new_tokens(cfg, cache_len)
    return {"task": "causal-lm", "threads": worker_threads(cfg.threads, cfg.workers),
            "max_new_tokens": limit, "default_new_tokens": min(DEFAULT_NEW_TOKENS, limit),
            "cache_len": cache_len,
            "compile": cfg.decode_compile or facts.get("compile") or "none",
            "chat_template": ctx.recipe.data.chat_template}


def run(state: State, cfg: PackageConfig, ctx: StageContext) -> State:
    """Archive the causal-LM export entering the stage with the generation handler."""
    export_dir = ctx.run_dir / state.source.outputs[0].export_dir
    handler = handler_settings(cfg, ctx, export_dir)
    if cfg.tensor_parallel:  # TorchServe starts each worker as a torchrun job of N ranks
        settings = {"parallelType": "tp", "torchrun": {"nproc-per-node": cfg.tensor_parallel}}
        handler["compile"] = "none"
        ctx.metrics.update(tensor_parallel=cfg.tensor_parallel)
    elif cfg.pipeline_parallel:  # the same torchrun job; each rank holds a pipeline stage
        settings = {"parallelType": "pp",
                    "torchrun": {"nproc-per-node": cfg.pipeline_parallel}}
        handler["compile"] = "none"
        ctx.metrics.update(pipeline_parallel=cfg.pipeline_parallel)
    else:  # continuous batching: TorchServe's asynchronous worker passes each request to
        # the handler as it arrives, which joins it to the running decode (serve/lm_batcher)
        # (one request a message; the handler's `rows` slots decode together)
        settings = {"asyncCommunication": True, "batchSize": 1}
        handler["rows"] = cfg.batch_size
        ctx.metrics.update(continuous_batching=True)
    ctx.metrics.update(max_new_tokens=handler["max_new_tokens"],
                       cache_len=handler["cache_len"], decode_compile=handler["compile"])
    return archive(state, cfg, ctx, handler, LM_HANDLER, LM_MODULES, LM_SERVED_METRICS,
                   settings)

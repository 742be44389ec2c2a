"""Stage `package` on a causal LM: a TorchServe `.mar` of a `format: transformers` export
with the streaming generation handler, ready for `compress serve`.

The archive holds the export folder's files, the `serve/` package with serve's own modules and
`serve/causal_lm/` whole (`runtime/`, what the export folder ships too, and `server/`: the
handler, its requests and answers, the continuous batch), the kernel library built here, and
a generated root module, `generation_handler.py`, that defines the one class TorchServe and
LitServe look for there (they import the handler by its file name from the archive's root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from compress.errors import CompressError
from compress.recipe.kinds.package import PackageConfig, causal_lm_max_new_tokens
from compress.serving.archive import code_tree
from compress.stages.context import StageContext, State
from compress.stages.package import archive
from serve.causal_lm.runtime import kernels
from serve.causal_lm.server.compiled_graphs import FOLDER
from serve.handler_settings import HandlerSettings
from serve.worker_threads import worker_threads

HANDLER = "serve.causal_lm.server.handler:CausalLMHandler"
ENTRY = "generation_handler.py"  # the archive's root module that defines the handler's class
CAUSAL_LM_SERVED_METRICS = ("perplexity", "perplexity_delta_vs_float_pct", "agreement",
                            "next_token_agreement", "decode_tok_s_b1", "ttft_ms",
                            "parity_token_agreement", "scheme", "runtime_threads")


def handler_settings(cfg: PackageConfig, ctx: StageContext, export_dir: Path) -> dict:
    """model-config.yaml's `handler:` section for the generation handler."""
    facts = json.loads((export_dir / "causal_lm.json").read_text())
    cache_len = cfg.cache_len or ctx.recipe.evaluation.generation.cache_len
    limit = causal_lm_max_new_tokens(cfg, cache_len)
    return {"task": "causal-lm", "threads": worker_threads(cfg.threads, cfg.workers),
            "max_new_tokens": limit,
            "default_new_tokens": min(HandlerSettings.default_new_tokens, limit),
            "cache_len": cache_len,
            "compile": cfg.decode_compile or facts.get("compile") or "none",
            "cpp_wrapper": cfg.decode_cpp_wrapper, "prefill_chunk": cfg.prefill_chunk,
            "prefill_compile": cfg.prefill_compile, "prefix_cache": cfg.prefix_cache,
            "prefix_cache_mb": cfg.prefix_cache_mb, "speculate": cfg.speculate,
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
    elif cfg.expert_parallel:  # the same torchrun job; each rank holds 1/N of the experts,
        # rank 0 alone gets the requests (TorchServe's pp) and leads every generation
        settings = {"parallelType": "pp", "torchrun": {"nproc-per-node": cfg.expert_parallel}}
        handler.update(compile="none", expert_parallel=cfg.expert_parallel)
        ctx.metrics.update(expert_parallel=cfg.expert_parallel)
    else:  # continuous batching: TorchServe's asynchronous worker passes each request to
        # the handler as it arrives, which joins it to the running decode (serve/causal_lm/batcher)
        # (one request a message; the handler's `rows` slots decode together)
        settings = {"asyncCommunication": True, "batchSize": 1}
        handler["rows"] = cfg.batch_size
        ctx.metrics.update(continuous_batching=True)
    ctx.metrics.update(max_new_tokens=handler["max_new_tokens"],
                       cache_len=handler["cache_len"], decode_compile=handler["compile"])
    tree, entry = code_tree(ctx.folder / ".archive_code", HANDLER, ENTRY)
    try:
        library = kernels.built_library()  # this CPU's build, used where it matches
        if library is not None:
            shutil.copy2(library, kernels.shipped_library(tree / "serve" / "causal_lm" / "runtime"))
        if cfg.precompile and handler["compile"] != "none" and "rows" in handler:
            precompile(tree, export_dir, handler, ctx)
        return archive(state, cfg, ctx, handler, HANDLER, CAUSAL_LM_SERVED_METRICS, settings,
                       code=(tree, entry))
    finally:
        shutil.rmtree(tree.parent, ignore_errors=True)


def precompile(tree: Path, export_dir: Path, handler: dict, ctx: StageContext) -> None:
    """Compile the graphs a worker of this archive serves, in a process of its own over the
    archive's `serve` package and an empty Inductor cache, into the archive's
    `compiled_graphs/` (serve/causal_lm/server/compiled_graphs.py); its lines go to the log."""
    began = time.perf_counter()
    # absolute: the child runs in `tree`, and a run folder given relative (output_dir=runs)
    # named the export and the output from where compress runs
    tree, export_dir = tree.resolve(), export_dir.resolve()
    command = [sys.executable, "-m", "serve.causal_lm.server.compiled_graphs", str(export_dir),
               json.dumps(handler), str(tree / FOLDER)]
    env = os.environ | {"PYTHONPATH": str(tree)}  # the child sets its own Inductor cache
    with subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as child:
        lines = deque(maxlen=20)
        for line in child.stdout or ():
            lines.append(line.rstrip())
            if line.startswith("precompile:"):
                ctx.log(f"package: {line[len('precompile:'):].strip()} "
                        f"({time.perf_counter() - began:.0f} s)")
    if child.returncode:
        raise CompressError("package: compiling the served graphs failed (set precompile: "
                            "false to compile them as the worker starts):\n"
                            + "\n".join(lines))
    ctx.metrics.update(precompile_s=round(time.perf_counter() - began, 1))

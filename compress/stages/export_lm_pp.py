"""`pipeline_parallel: N` on a causal-LM export: torchrun runs the folder's own
`lm_pipeline_parallel.py` on N processes (gloo on CPU, NCCL on GPUs), which cuts the decoder
layers into N stages with `torch.distributed.pipelining` (GPipe micro-batches, no KV cache
across stages) and compares them with the whole model in one process: logits on the prompts
(within `tolerance`, default 1e-4, in float32), greedy tokens (`min_agreement`, default all),
the weight bytes each rank holds, and tokens/s at batch 8 with 1, 2 and 4 micro-batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from compress.distributed.launch import TORCHRUN_ENV
from compress.errors import CompressError, ParityError
from compress.recipe.kinds.export import ExportConfig
from compress.recipe.pipeline_parallel_checks import split_problem
from compress.stages.context import StageContext

DEFAULT_TOLERANCE = 1e-4
TIMEOUT_S = 1800


def run_pipeline_script(folder: Path, ranks: int, prompts: list[Any], ctx: StageContext
                        ) -> dict[str, Any]:
    """The figures of the folder's `lm_pipeline_parallel.py` under torchrun on `ranks`
    processes (written to the stage folder's pipeline_parallel.json, tokens left out)."""
    prompt_file, out = ctx.folder / "pp_prompts.json", ctx.folder / "pipeline_parallel.json"
    prompt_file.write_text(json.dumps(prompts))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(ranks), str(folder / "lm_pipeline_parallel.py"),
               str(folder), "--prompts", str(prompt_file), "--out", str(out),
               "--max-new-tokens", str(ctx.recipe.evaluation.generation.max_new_tokens)]
    if not ctx.recipe.data.chat_template:
        command.append("--no-chat-template")
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks)),
           **TORCHRUN_ENV}
    ctx.log(f"{ctx.name}: pipeline parallel: torchrun on {ranks} processes")
    done = subprocess.run(command, capture_output=True, text=True, env=env,
                          timeout=TIMEOUT_S, check=False)
    if done.returncode or not out.is_file():
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["?"]
        raise CompressError(f"pipeline-parallel check failed on {ranks} processes: "
                            f"{last[0][:240]}")
    figures = json.loads(out.read_text())
    figures.pop("tokens", None)
    figures.pop("tokens_one_process", None)
    out.write_text(json.dumps(figures, indent=2))
    return figures


def check_pipeline_parallel(folder: Path, cfg: ExportConfig, prompts: list[Any],
                            ctx: StageContext) -> dict[str, Any]:
    """Run the pipeline-parallel comparison on the exported folder; record and check it."""
    ranks = int(cfg.pipeline_parallel or 0)
    problem = split_problem(json.loads((folder / "config.json").read_text()), ranks)
    if problem:  # a prune stage may have dropped layers since validation
        raise CompressError(problem)
    figures = run_pipeline_script(folder, ranks, prompts, ctx)
    projections = figures["projection_weight_bytes_per_rank"]
    held, whole = figures["weight_bytes_per_rank"], figures["weight_bytes_one_process"]
    ctx.metrics.update(
        pp_processes=ranks, pp_schedule=figures["schedule"],
        pp_layers_per_rank=figures["layers_per_rank"],
        pp_max_logit_diff=figures["max_logit_diff"],
        pp_greedy_agreement=figures["greedy_agreement"],
        pp_weight_mb_per_rank=[round(b / 1e6, 3) for b in held],
        pp_weight_share=round(max(held) / whole, 4),
        pp_projection_weight_share=round(
            max(projections) / figures["projection_weight_bytes_one_process"], 4),
        pp_generate_tok_s_b8_one_process=figures["generate_tok_s_b8_one_process"],
        **{f"pp_generate_tok_s_b8_mb{k}": v for k, v in figures["generate_tok_s_b8"].items()})
    where = (ctx.folder / "pipeline_parallel.json").relative_to(ctx.run_dir)
    tolerance = cfg.tolerance or DEFAULT_TOLERANCE
    if figures["max_logit_diff"] > tolerance:
        raise ParityError(f"{where}: pipeline-parallel logits differ from one process by "
                          f"{figures['max_logit_diff']:.3g} > {tolerance}")
    need = cfg.min_agreement or 1.0
    if figures["greedy_agreement"] < need:
        raise ParityError(f"{where}: pipeline-parallel greedy tokens agree with one process's "
                          f"at {figures['greedy_agreement']} of the positions < {need}")
    return figures

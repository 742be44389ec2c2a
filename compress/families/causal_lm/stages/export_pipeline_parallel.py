"""`pipeline_parallel: N` on a causal-LM export: torchrun runs the folder's own
`causal_lm.pipeline_parallel` on N processes (gloo on CPU, NCCL on GPUs), which cuts the decoder
layers into N stages with `torch.distributed.pipelining` (GPipe micro-batches, no KV cache
across stages) and compares them with the whole model in one process: logits on the prompts
(within `tolerance`, default 1e-4, in float32), greedy tokens (`min_agreement`, default all),
the weight bytes each rank holds, and tokens/s at batch 8 with 1, 2 and 4 micro-batches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compress.errors import CompressError
from compress.families.causal_lm.stages.export_tensor_parallel import (
    check_parity,
    run_comparison_script,
)
from compress.recipe.kinds.export import ExportConfig
from compress.recipe.pipeline_parallel_checks import split_problem
from compress.stages.context import StageContext

DEFAULT_TOLERANCE = 1e-4


def run_pipeline_script(folder: Path, ranks: int, prompts: list[Any], ctx: StageContext
                        ) -> dict[str, Any]:
    """The figures of the folder's `causal_lm.pipeline_parallel` under torchrun on `ranks`
    processes (written to the stage folder's pipeline_parallel.json, tokens left out)."""
    return run_comparison_script(folder, "causal_lm.pipeline_parallel", "pipeline_parallel", ranks,
                                 prompts, ctx)


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
    check_parity(figures, cfg, "pipeline_parallel", ctx, DEFAULT_TOLERANCE)
    return figures

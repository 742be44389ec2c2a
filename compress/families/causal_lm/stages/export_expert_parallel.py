"""`expert_parallel: N` on a causal-LM export: torchrun runs the folder's own
`causal_lm.expert_parallel` on N processes (gloo on CPU, NCCL on GPUs), which gives each rank
1/N of every mixture-of-experts layer's experts, sends tokens to them and back with
`all_to_all_single`, and compares it with the whole model in one process: logits on the
prompts (within `tolerance`, default 1e-5, in float32), greedy tokens (`min_agreement`,
default all), the expert weight bytes each rank holds, decode tokens/s at batch 8 with 1 and
N ranks, and each decode step's collectives (the communication telemetry's all_to_all)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compress.distributed.comm import step_of_record
from compress.errors import CompressError
from compress.families.causal_lm.stages.export_tensor_parallel import (
    check_parity,
    run_comparison_script,
)
from compress.recipe.kinds.export import ExportConfig
from compress.stages.context import StageContext
from serve.causal_lm.expert_parallel import split_problem

DEFAULT_TOLERANCE = 1e-5


def comm_metrics(figures: dict[str, Any]) -> dict[str, Any]:
    """The communication telemetry of an expert-parallel decode step at batch 8 (the
    busiest rank's): megabytes, seconds and share, and seconds per kind of collective."""
    steps = [step_of_record(per_kind) for per_kind in figures["comm_per_step"]]
    busiest = max(steps, key=lambda s: s.seconds or 0.0)
    step_s = figures["decode_step_ms_b8"] / 1e3
    out = {"ep_comm_mb_per_step": [round(s.nbytes / 1e6, 6) for s in steps],
           "ep_comm_s_per_step": round(busiest.seconds or 0.0, 6),
           "ep_comm_share": round(busiest.share(step_s) or 0.0, 4)}
    out.update({f"ep_comm_{kind}_s_per_step": round(s, 6)
                for kind, s in busiest.by_kind.items()})
    return out


def check_expert_parallel(folder: Path, cfg: ExportConfig, prompts: list[Any],
                          ctx: StageContext) -> dict[str, Any]:
    """Run the expert-parallel comparison on the exported folder; record and check it."""
    ranks = int(cfg.expert_parallel or 0)
    problem = split_problem(json.loads((folder / "config.json").read_text()), ranks)
    if problem:  # a stage may have changed the experts since validation
        raise CompressError(problem)
    figures = run_comparison_script(folder, "causal_lm.expert_parallel", "expert_parallel",
                                    ranks, prompts, ctx)
    held = figures["expert_weight_bytes_per_rank"]
    whole = figures["expert_weight_bytes_one_process"]
    ctx.metrics.update(
        ep_processes=ranks, ep_max_logit_diff=figures["max_logit_diff"],
        ep_greedy_agreement=figures["greedy_agreement"],
        ep_expert_weight_mb_per_rank=[round(b / 1e6, 6) for b in held],
        ep_expert_weight_share=round(max(held) / whole, 6),
        ep_decode_tok_s_b8=figures["decode_tok_s_b8"],
        ep_decode_tok_s_b8_one_process=figures["decode_tok_s_b8_one_process"],
        ep_decode_tok_s_b8_one_process_rank_threads=figures[
            "decode_tok_s_b8_one_process_rank_threads"],
        ep_all_to_all_share=figures["all_to_all_share"], **comm_metrics(figures))
    check_parity(figures, cfg, "expert_parallel", ctx, DEFAULT_TOLERANCE)
    return figures

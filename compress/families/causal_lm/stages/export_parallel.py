"""The splits of a causal-LM export, each run and checked against the whole model: torchrun
runs the folder's own `causal_lm.runtime.<split>` on N processes (gloo on CPU, NCCL on GPUs),
which compares the split model with the whole one in one process. Its figures (token lists
left out) go to the stage folder's `<split>.json` and into the stage's metrics; its logits
on the prompts must be within `tolerance` of one process's (in float32), and its greedy
tokens (but tensor_parallel's) agree at `min_agreement` of the positions (default all).

- `tensor_parallel`: the decoder layers split with torch's DTensor tensor parallelism;
  tolerance 1e-4; the linear-weight bytes each rank holds and decode tokens/s of both.
- `pipeline_parallel`: the decoder layers cut into N stages with `torch.distributed.pipelining`
  (GPipe micro-batches, no KV cache across stages); tolerance 1e-4; the weight bytes each rank
  holds and tokens/s at batch 8 with 1, 2 and 4 micro-batches.
- `expert_parallel`: each rank 1/N of every mixture-of-experts layer's experts, tokens sent to
  them and back with `all_to_all_single`; tolerance 1e-5; the expert weight bytes each rank
  holds, decode tokens/s at batch 8 with 1 and N ranks, and each decode step's collectives
  (the communication telemetry's all_to_all).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compress.distributed.comm import step_of_record
from compress.distributed.launch import TORCHRUN_ENV
from compress.errors import CompressError, ParityError
from compress.recipe.kinds.export import ExportConfig
from compress.recipe.parallel import pipeline_split_problem
from compress.stages.context import StageContext
from serve.causal_lm.runtime import expert_parallel, tensor_parallel

TIMEOUT_S = 1800
# A rank's exception line, bare or behind torchrun's `[rank0]: ` prefix.
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception|Interrupt)\b:.*)")


@dataclass(frozen=True)
class Split:
    """How an export checks one way of splitting the model."""

    problem: Callable[[dict[str, Any], int], str | None]  # why N ranks cannot split a config
    tolerance: float  # the largest logit difference accepted when the stage sets none
    agreement: bool  # whether its greedy tokens must agree too
    metrics: Callable[[dict[str, Any], int], dict[str, Any]]  # (figures, ranks) -> metrics


def check_splits(folder: Path, cfg: ExportConfig, prompts: list[Any],
                 ctx: StageContext) -> None:
    """Run each comparison the export asks for on the exported folder; record and check it."""
    for kind, split in SPLITS.items():
        ranks = int(getattr(cfg, kind) or 0)
        if not ranks:
            continue
        problem = split.problem(json.loads((folder / "config.json").read_text()), ranks)
        if problem:  # a GGUF source had no config.json to validate, or a stage (prune,
            raise CompressError(problem)  # moefy) has changed the layers or experts since
        figures = run_comparison_script(folder, f"causal_lm.runtime.{kind}", kind, ranks,
                                        prompts, ctx)
        ctx.metrics.update(split.metrics(figures, ranks))
        check_parity(figures, cfg, kind, ctx, split.tolerance, split.agreement)


def run_comparison_script(folder: Path, module: str, kind: str, ranks: int,
                          prompts: list[Any], ctx: StageContext) -> dict[str, Any]:
    """The figures of the folder's comparison `module` (`causal_lm.runtime.<kind>`) under
    torchrun on `ranks` processes, run in the folder (its package first on the path), written
    to the stage folder's `<kind>.json` with their token lists left out."""
    folder = folder.resolve()
    prompt_file = (ctx.folder / f"{kind}_prompts.json").resolve()
    out = (ctx.folder / f"{kind}.json").resolve()
    prompt_file.write_text(json.dumps(prompts))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(ranks), "-m", module, str(folder),
               "--prompts", str(prompt_file), "--out", str(out),
               "--max-new-tokens", str(ctx.recipe.evaluation.generation.max_new_tokens)]
    if not ctx.recipe.data.chat_template:
        command.append("--no-chat-template")
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks)),
           **TORCHRUN_ENV}
    what = kind.replace("_", " ")
    ctx.log(f"{ctx.name}: {what}: torchrun on {ranks} processes")
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=folder,
                          timeout=TIMEOUT_S, check=False)
    if done.returncode or not out.is_file():
        log = ctx.folder / f"{kind}.log"
        log.write_text(done.stdout + done.stderr)
        raise CompressError(f"{what.replace(' ', '-')} check failed on {ranks} processes: "
                            f"{_first_error(done.stderr)[:240]} (torchrun's output: "
                            f"{log.relative_to(ctx.run_dir)})")
    figures = {k: v for k, v in json.loads(out.read_text()).items()
               if not k.startswith("tokens")}
    out.write_text(json.dumps(figures, indent=2))
    return figures


def _first_error(stderr: str) -> str:
    """The first line of a failed torchrun that names an error (its last line otherwise):
    the rank's own exception, not the agent's summary after it."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    named = [m.group(1) for m in map(_EXCEPTION_LINE.match, lines) if m]
    return (named or lines[-1:] or ["?"])[0]


def check_parity(figures: dict[str, Any], cfg: ExportConfig, kind: str, ctx: StageContext,
                 default_tolerance: float, agreement: bool = True) -> None:
    """Refuse a split model whose logits differ from one process's by more than the
    stage's `tolerance`, or (with `agreement`) whose greedy tokens agree at fewer positions
    than `min_agreement` (default all)."""
    where = (ctx.folder / f"{kind}.json").relative_to(ctx.run_dir)
    what = kind.replace("_", "-")
    tolerance = cfg.tolerance or default_tolerance
    if figures["max_logit_diff"] > tolerance:
        raise ParityError(f"{where}: {what} logits differ from one process by "
                          f"{figures['max_logit_diff']:.3g} > {tolerance}")
    need = cfg.min_agreement or 1.0
    if agreement and figures["greedy_agreement"] < need:
        raise ParityError(f"{where}: {what} greedy tokens agree with one process's at "
                          f"{figures['greedy_agreement']} of the positions < {need}")


def _tensor_metrics(figures: dict[str, Any], ranks: int) -> dict[str, Any]:
    held = figures["linear_weight_bytes_per_rank"]
    whole = figures["linear_weight_bytes_one_process"]
    return {"tp_processes": ranks, "tp_max_logit_diff": figures["max_logit_diff"],
            "tp_greedy_agreement": figures["greedy_agreement"],
            "tp_linear_weight_mb_per_rank": [round(b / 1e6, 3) for b in held],
            "tp_linear_weight_share": round(max(held) / whole, 4),
            "tp_decode_tok_s_b1": figures["decode_tok_s_b1"],
            "tp_decode_tok_s_b1_one_process": figures["decode_tok_s_b1_one_process"]}


def _pipeline_metrics(figures: dict[str, Any], ranks: int) -> dict[str, Any]:
    projections = figures["projection_weight_bytes_per_rank"]
    held, whole = figures["weight_bytes_per_rank"], figures["weight_bytes_one_process"]
    return {"pp_processes": ranks, "pp_schedule": figures["schedule"],
            "pp_layers_per_rank": figures["layers_per_rank"],
            "pp_max_logit_diff": figures["max_logit_diff"],
            "pp_greedy_agreement": figures["greedy_agreement"],
            "pp_weight_mb_per_rank": [round(b / 1e6, 3) for b in held],
            "pp_weight_share": round(max(held) / whole, 4),
            "pp_projection_weight_share": round(
                max(projections) / figures["projection_weight_bytes_one_process"], 4),
            "pp_generate_tok_s_b8_one_process": figures["generate_tok_s_b8_one_process"],
            **{f"pp_generate_tok_s_b8_mb{k}": v
               for k, v in figures["generate_tok_s_b8"].items()}}


def _expert_metrics(figures: dict[str, Any], ranks: int) -> dict[str, Any]:
    held = figures["expert_weight_bytes_per_rank"]
    whole = figures["expert_weight_bytes_one_process"]
    return {"ep_processes": ranks, "ep_max_logit_diff": figures["max_logit_diff"],
            "ep_greedy_agreement": figures["greedy_agreement"],
            "ep_expert_weight_mb_per_rank": [round(b / 1e6, 6) for b in held],
            "ep_expert_weight_share": round(max(held) / whole, 6),
            "ep_decode_tok_s_b8": figures["decode_tok_s_b8"],
            "ep_decode_tok_s_b8_one_process": figures["decode_tok_s_b8_one_process"],
            "ep_decode_tok_s_b8_one_process_rank_threads": figures[
                "decode_tok_s_b8_one_process_rank_threads"],
            "ep_all_to_all_share": figures["all_to_all_share"], **comm_metrics(figures)}


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


SPLITS = {  # in the order they run
    "tensor_parallel": Split(tensor_parallel.split_problem, 1e-4, False, _tensor_metrics),
    "pipeline_parallel": Split(pipeline_split_problem, 1e-4, True, _pipeline_metrics),
    "expert_parallel": Split(expert_parallel.split_problem, 1e-5, True, _expert_metrics),
}

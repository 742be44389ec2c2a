"""`tensor_parallel: N` on a causal-LM export: torchrun runs the folder's own
`causal_lm.tensor_parallel` on N processes (gloo on CPU, NCCL on GPUs), which splits the decoder
layers with torch's DTensor tensor parallelism and compares them with the unsplit model in one
process: logits on the prompts (within `tolerance`, default 1e-4, in float32), greedy
tokens, the linear-weight bytes each rank holds, and decode tokens/s of both."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from compress.distributed.launch import TORCHRUN_ENV
from compress.errors import CompressError, ParityError
from compress.recipe.kinds.export import ExportConfig
from compress.stages.context import StageContext
from serve.causal_lm.tensor_parallel import split_problem

DEFAULT_TOLERANCE = 1e-4
TIMEOUT_S = 1800
# A rank's exception line, bare or behind torchrun's `[rank0]: ` prefix.
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]*(?:Error|Exception|Interrupt)\b:.*)")


def run_comparison_script(folder: Path, module: str, kind: str, ranks: int,
                          prompts: list[Any], ctx: StageContext) -> dict[str, Any]:
    """The figures of the folder's comparison `module` (causal_lm.tensor_parallel or
    causal_lm.pipeline_parallel) under torchrun on `ranks` processes, run in the folder (its
    package first on the path), written to the stage folder's `<kind>.json` with their token
    lists left out."""
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


def check_tensor_parallel(folder: Path, cfg: ExportConfig, prompts: list[Any],
                          ctx: StageContext) -> dict[str, Any]:
    """Run the tensor-parallel comparison on the exported folder; record and check it."""
    ranks = int(cfg.tensor_parallel or 0)
    problem = split_problem(json.loads((folder / "config.json").read_text()), ranks)
    if problem:  # a GGUF source has no config.json to check before the run
        raise CompressError(problem)
    figures = run_comparison_script(folder, "causal_lm.tensor_parallel", "tensor_parallel", ranks,
                                    prompts, ctx)
    held = figures["linear_weight_bytes_per_rank"]
    whole = figures["linear_weight_bytes_one_process"]
    ctx.metrics.update(
        tp_processes=ranks, tp_max_logit_diff=figures["max_logit_diff"],
        tp_greedy_agreement=figures["greedy_agreement"],
        tp_linear_weight_mb_per_rank=[round(b / 1e6, 3) for b in held],
        tp_linear_weight_share=round(max(held) / whole, 4),
        tp_decode_tok_s_b1=figures["decode_tok_s_b1"],
        tp_decode_tok_s_b1_one_process=figures["decode_tok_s_b1_one_process"])
    check_parity(figures, cfg, "tensor_parallel", ctx, DEFAULT_TOLERANCE, agreement=False)
    return figures

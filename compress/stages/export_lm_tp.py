"""`tensor_parallel: N` on a causal-LM export: torchrun runs the folder's own
`lm_tensor_parallel.py` on N processes (gloo on CPU, NCCL on GPUs), which splits the decoder
layers with torch's DTensor tensor parallelism and compares them with the unsplit model in one
process: logits on the prompts (within `tolerance`, default 1e-4, in float32), greedy
tokens, the linear-weight bytes each rank holds, and decode tokens/s of both."""

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
from compress.stages.context import StageContext
from serve.lm_tensor_parallel import split_problem

DEFAULT_TOLERANCE = 1e-4
TIMEOUT_S = 1800


def check_tensor_parallel(folder: Path, cfg: ExportConfig, prompts: list[Any],
                          ctx: StageContext) -> dict[str, Any]:
    """Run the tensor-parallel comparison on the exported folder; record and check it."""
    ranks = int(cfg.tensor_parallel or 0)
    problem = split_problem(json.loads((folder / "config.json").read_text()), ranks)
    if problem:  # a GGUF source has no config.json to check before the run
        raise CompressError(problem)
    script = folder / "lm_tensor_parallel.py"
    prompt_file, out = ctx.folder / "tp_prompts.json", ctx.folder / "tensor_parallel.json"
    prompt_file.write_text(json.dumps(prompts))
    gen = ctx.recipe.evaluation.generation
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(ranks), str(script), str(folder),
               "--prompts", str(prompt_file), "--out", str(out),
               "--max-new-tokens", str(gen.max_new_tokens)]
    if not ctx.recipe.data.chat_template:
        command.append("--no-chat-template")
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks)),
           **TORCHRUN_ENV}
    ctx.log(f"{ctx.name}: tensor parallel: torchrun on {ranks} processes")
    done = subprocess.run(command, capture_output=True, text=True, env=env,
                          timeout=TIMEOUT_S, check=False)
    if done.returncode or not out.is_file():
        last = [line for line in done.stderr.splitlines() if line.strip()][-1:] or ["?"]
        raise CompressError(f"tensor-parallel check failed on {ranks} processes: "
                            f"{last[0][:240]}")
    figures = json.loads(out.read_text())
    figures.pop("tokens", None)
    out.write_text(json.dumps(figures, indent=2))
    held = figures["linear_weight_bytes_per_rank"]
    whole = figures["linear_weight_bytes_one_process"]
    ctx.metrics.update(
        tp_processes=ranks, tp_max_logit_diff=figures["max_logit_diff"],
        tp_greedy_agreement=figures["greedy_agreement"],
        tp_linear_weight_mb_per_rank=[round(b / 1e6, 3) for b in held],
        tp_linear_weight_share=round(max(held) / whole, 4),
        tp_decode_tok_s_b1=figures["decode_tok_s_b1"],
        tp_decode_tok_s_b1_one_process=figures["decode_tok_s_b1_one_process"])
    tolerance = cfg.tolerance or DEFAULT_TOLERANCE
    if figures["max_logit_diff"] > tolerance:
        raise ParityError(f"{out.relative_to(ctx.run_dir)}: tensor-parallel logits differ from "
                          f"one process by {figures['max_logit_diff']:.3g} > {tolerance}")
    return figures

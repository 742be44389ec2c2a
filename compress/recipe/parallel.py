"""A causal LM split across processes, an export's or a package's: the options
(`tensor_parallel`, `pipeline_parallel`, `expert_parallel`, `oversubscribe`), declared once
for both configs, and their checks without torch.

- tensor_parallel: a float model whose key-value heads and feed-forward neurons N divides;
- pipeline_parallel: a stage for every rank (no more ranks than decoder layers) and a
  float32 model;
- expert_parallel: a mixture-of-experts model whose experts per layer N divides (or those a
  moefy stage makes);
- one split a stage, on no more processes than this machine has cores unless
  `oversubscribe`.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

from pydantic import Field

TensorParallel = Annotated[int | None, Field(
    ge=2, le=64, description="Causal LMs: split the decoder layers across N torchrun "
    "processes with torch's (DTensor) tensor parallelism; takes a float model. An export "
    "also runs the split (causal_lm/runtime/tensor_parallel.py in the folder) and checks its "
    "logits against one process (tolerance, default 1e-4); a package serves each worker as "
    "a torchrun job of N ranks (TorchServe's parallelType: tp), with no compiled decode.")]
PipelineParallel = Annotated[int | None, Field(
    ge=2, le=64, description="Causal LMs: cut the decoder layers into N pipeline stages on N "
    "torchrun processes (torch.distributed.pipelining), each token recomputed through them "
    "(no KV cache); takes a float32 model. An export also runs it (GPipe micro-batches; "
    "causal_lm/runtime/pipeline_parallel.py in the folder), checks its logits against one "
    "process (tolerance, default 1e-4) and its greedy tokens (min_agreement), and records "
    "each rank's weight bytes and tokens/s at batch 8 with 1, 2 and 4 micro-batches; a "
    "package serves each worker as a torchrun job of N ranks (TorchServe's parallelType: "
    "pp), with no compiled decode.")]
ExpertParallel = Annotated[int | None, Field(
    ge=2, le=64, description="Mixture-of-experts causal LMs: give each of N torchrun "
    "processes 1/N of every layer's experts, tokens sent to them and back with "
    "all_to_all_single. An export also runs it (causal_lm/runtime/expert_parallel.py in the "
    "folder), checks its logits against one process (tolerance, default 1e-5) and its "
    "greedy tokens (min_agreement), and records each rank's expert bytes, tokens/s at batch "
    "8 and the all-to-all share; a package serves each worker as a torchrun job of N ranks, "
    "rank 0 taking the requests and leading, with no compiled decode.")]
Oversubscribe = Annotated[bool, Field(
    description="tensor_parallel, pipeline_parallel, expert_parallel: allow more processes "
    "than this machine has cores (they share them and run slower).")]
SPLITS = ("tensor_parallel", "pipeline_parallel", "expert_parallel")
PARALLEL = (*SPLITS, "oversubscribe")

WEIGHT_ONLY = ("int8_weight_only", "int4_weight_only")
MAKES_EXPERTS = ("moefy",)  # stage kinds that turn a dense model into a mixture of experts


def parallel_problems(recipe: Any, i: int) -> list[str]:
    """The splits of stage `i` (a StageSpec's `check`): tensor, then pipeline, then expert
    parallel; `oversubscribe` without any of them."""
    stage = recipe.stages[i]
    if getattr(stage, "oversubscribe", False) and not any(
            getattr(stage, split, None) for split in SPLITS):
        return [f"stages.{i}.oversubscribe: applies to tensor_parallel, pipeline_parallel or "
                "expert_parallel; set one of them, or drop it"]
    return _tensor_problems(recipe, i) + _pipeline_problems(recipe, i) + _expert_problems(
        recipe, i)


def parallel_fits_the_config(recipe: Any, i: int, config: dict[str, Any]) -> list[str]:
    """The splits of stage `i` against the model's config.json (a StageSpec's
    `check_model`): its heads and neurons, its decoder layers, its experts."""
    stage = recipe.stages[i]
    problems = []
    ranks = getattr(stage, "tensor_parallel", None)
    if ranks and "intermediate_size" in config:
        from serve.causal_lm.runtime.tensor_parallel import split_problem as tensor_problem

        problems.append(tensor_problem(config, ranks))
    ranks = getattr(stage, "pipeline_parallel", None)
    if ranks:
        problems.append(pipeline_split_problem(config, ranks))
    ranks = getattr(stage, "expert_parallel", None)
    if ranks and ("model_type" in config or "num_hidden_layers" in config) and (
            _made_experts(recipe, i) is None):  # else _expert_problems checks its experts
        from serve.causal_lm.runtime.expert_parallel import split_problem as expert_problem

        problems.append(expert_problem(config, ranks))
    return [f"stages.{i}.{problem}" for problem in problems if problem]


def pipeline_split_problem(config: dict[str, Any], ranks: int) -> str | None:
    """Why `ranks` pipeline stages cannot split a model of this config (config.json's keys):
    each stage takes whole decoder layers, at least one (None when they can)."""
    layers = config.get("num_hidden_layers")
    if layers and ranks > layers:
        return (f"pipeline_parallel: {ranks} stages for the model's {layers} decoder layers "
                f"would leave a stage with none; use {layers} or fewer")
    return None


def too_many_processes(stage: Any, where: str, ranks: int) -> list[str]:
    """A split over more processes than this machine's cores, unless the stage sets
    `oversubscribe`."""
    cores = os.cpu_count() or 1
    if ranks <= cores or getattr(stage, "oversubscribe", False):
        return []
    return [f"{where}: {ranks} processes is more than the {cores} CPU cores of this machine; "
            f"use {cores} or fewer, or set oversubscribe: true to run them anyway (slower)"]


def _tensor_problems(recipe: Any, i: int) -> list[str]:
    """tensor_parallel on stage `i`: a float model, and no more processes than this
    machine's cores unless `oversubscribe`."""
    from compress.recipe.chain import model_chain

    stage = recipe.stages[i]
    ranks = getattr(stage, "tensor_parallel", None)
    if not ranks:
        return []
    problems = []
    quantized = [j for j in model_chain(recipe, i) if getattr(recipe.stages[j], "scheme", None)]
    if quantized:
        problems.append(f"stages.{i}.tensor_parallel: splits a float model, and this "
                        f"{stage.kind} follows the quantize stage {quantized[-1]}; take the "
                        f"model from a stage before it")
    return problems + too_many_processes(stage, f"stages.{i}.tensor_parallel", ranks)


def _pipeline_problems(recipe: Any, i: int) -> list[str]:
    """pipeline_parallel on stage `i`: alone (no tensor_parallel), a float32 model, and no
    more processes than this machine's cores unless `oversubscribe`."""
    stage = recipe.stages[i]
    ranks = getattr(stage, "pipeline_parallel", None)
    where = f"stages.{i}.pipeline_parallel"
    if not ranks:
        return []
    problems = []
    if getattr(stage, "tensor_parallel", None):
        problems.append(f"{where}: tensor_parallel is set too, and a stage splits the "
                        "model one way only; drop one of them")
    bf16 = _bfloat16_stage(recipe, i)
    if bf16 is not None:
        problems.append(f"{where}: recomputes every token with no KV cache, whose bfloat16 "
                        f"logits part from the cached one-process decoder's at near-ties, and "
                        f"stage {bf16} computes in bfloat16; quantize with activations: "
                        f"float32 (or int8_grouped, int4_grouped), or take a stage before it")
    return problems + too_many_processes(stage, where, ranks)


def _expert_problems(recipe: Any, i: int) -> list[str]:
    """expert_parallel on stage `i`: alone (no other split), dividing the experts a moefy
    stage makes, and no more processes than this machine's cores unless `oversubscribe`."""
    stage = recipe.stages[i]
    ranks = getattr(stage, "expert_parallel", None)
    if not ranks:
        return []
    where = f"stages.{i}.expert_parallel"
    problems = [f"{where}: {other} is set too, and a stage splits the model one way only; "
                "drop one of them" for other in ("tensor_parallel", "pipeline_parallel")
                if getattr(stage, other, None)]
    made = _made_experts(recipe, i)  # checked here: a GGUF source has no config.json
    if made is not None and isinstance(getattr(made, "experts", None), int):
        from serve.causal_lm.runtime.expert_parallel import split_problem

        problem = split_problem({"num_experts": made.experts}, ranks)
        if problem:
            problems.append(f"stages.{i}.{problem} (made by the {made.kind} stage)")
    return problems + too_many_processes(stage, where, ranks)


def _bfloat16_stage(recipe: Any, i: int) -> int | None:
    """The stage behind stage i's model that made it compute in bfloat16 (a bf16 cast, or a
    weight scheme with bfloat16 activations: `activations: auto` resolved as
    compress.families.causal_lm.stages.quantize.activation_dtype does), else None."""
    from compress.recipe.chain import model_chain
    from compress.recipe.registry import bf16_cpu_present, spec_of

    for j in reversed(model_chain(recipe, i)):
        stage = recipe.stages[j]
        if spec_of(stage.kind).precision(stage) == "bf16":
            return j
        scheme = getattr(stage, "scheme", None)
        if scheme:
            chosen = getattr(stage, "activations", "auto")
            if chosen == "auto":
                bf16 = scheme in WEIGHT_ONLY or (scheme == "int8_dynamic"
                                                 and bf16_cpu_present())
            else:
                bf16 = chosen == "bfloat16"
            return j if bf16 else None
    return None


def _made_experts(recipe: Any, i: int) -> Any:
    """The stage behind stage i's model that made its experts (a moefy stage), else None."""
    from compress.recipe.chain import model_chain

    for j in reversed(model_chain(recipe, i)):
        if recipe.stages[j].kind in MAKES_EXPERTS:
            return recipe.stages[j]
    return None

"""Checks of `pipeline_parallel: N` (an export's or a package's), without torch: a stage for
every rank (no more ranks than decoder layers), a float32 model, no tensor_parallel beside
it, and no more processes than this machine has cores unless `oversubscribe`."""

from __future__ import annotations

from typing import Any

from compress.recipe.tensor_parallel_checks import too_many_processes

WEIGHT_ONLY = ("int8_weight_only", "int4_weight_only")


def split_problem(config: dict[str, Any], ranks: int) -> str | None:
    """Why `ranks` pipeline stages cannot split a model of this config (config.json's keys):
    each stage takes whole decoder layers, at least one (None when they can)."""
    layers = config.get("num_hidden_layers")
    if layers and ranks > layers:
        return (f"pipeline_parallel: {ranks} stages for the model's {layers} decoder layers "
                f"would leave a stage with none; use {layers} or fewer")
    return None


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


def pipeline_problems(recipe: Any, i: int) -> list[str]:
    """pipeline_parallel on stage `i`: alone (no tensor_parallel), a float32 model, and no
    more processes than this machine's cores unless `oversubscribe`."""
    stage = recipe.stages[i]
    ranks = getattr(stage, "pipeline_parallel", None)
    where = f"stages.{i}.pipeline_parallel"
    if not ranks:
        if getattr(stage, "oversubscribe", False) and not any(
                getattr(stage, k, None) for k in ("tensor_parallel", "expert_parallel")):
            return [f"stages.{i}.oversubscribe: applies to tensor_parallel, "
                    "pipeline_parallel or expert_parallel; set one of them, or drop it"]
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


def stages_fit_the_config(recipe: Any, i: int, config: dict[str, Any]) -> list[str]:
    """pipeline_parallel leaves every stage at least one of the model's decoder layers."""
    ranks = getattr(recipe.stages[i], "pipeline_parallel", None)
    problem = split_problem(config, ranks) if ranks else None
    return [f"stages.{i}.{problem}"] if problem else []

"""Checks of `expert_parallel: N` (an export's or a package's), without torch: a
mixture-of-experts causal LM whose experts per layer N divides, no tensor_parallel or
pipeline_parallel beside it, and no more processes than this machine has cores unless
`oversubscribe`."""

from __future__ import annotations

from typing import Any

from compress.recipe.tensor_parallel_checks import too_many_processes
from serve.causal_lm.expert_parallel import split_problem  # no torch import

OTHER_SPLITS = ("tensor_parallel", "pipeline_parallel")
MAKES_EXPERTS = ("moefy",)  # stage kinds that turn a dense model into a mixture of experts


def expert_problems(recipe: Any, i: int) -> list[str]:
    """expert_parallel on stage `i`: alone (no other split), dividing the experts a moefy
    stage makes, and no more processes than this machine's cores unless `oversubscribe`."""
    stage = recipe.stages[i]
    ranks = getattr(stage, "expert_parallel", None)
    if not ranks:
        return []
    where = f"stages.{i}.expert_parallel"
    problems = [f"{where}: {other} is set too, and a stage splits the model one way only; "
                "drop one of them" for other in OTHER_SPLITS if getattr(stage, other, None)]
    made = _made_experts(recipe, i)  # checked here: a GGUF source has no config.json
    if made is not None and isinstance(getattr(made, "experts", None), int):
        problem = split_problem({"num_experts": made.experts}, ranks)
        if problem:
            problems.append(f"stages.{i}.{problem} (made by the {made.kind} stage)")
    return problems + too_many_processes(stage, where, ranks)


def _made_experts(recipe: Any, i: int) -> Any:
    """The stage behind stage i's model that made its experts (a moefy stage), else None."""
    from compress.recipe.chain import model_chain

    for j in reversed(model_chain(recipe, i)):
        if recipe.stages[j].kind in MAKES_EXPERTS:
            return recipe.stages[j]
    return None


def experts_fit_the_config(recipe: Any, i: int, config: dict[str, Any]) -> list[str]:
    """expert_parallel takes a mixture-of-experts model whose experts per layer it divides
    (unless a moefy stage makes the experts)."""
    ranks = getattr(recipe.stages[i], "expert_parallel", None)
    if not ranks or "model_type" not in config and "num_hidden_layers" not in config:
        return []
    if _made_experts(recipe, i) is not None:  # expert_problems checks its experts
        return []
    problem = split_problem(config, ranks)
    return [f"stages.{i}.{problem}"] if problem else []

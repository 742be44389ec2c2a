"""Checks of `tensor_parallel: N` (an export's or a package's), without torch: a float causal
LM whose key-value heads and feed-forward neurons N divides, on no more processes than this
machine has cores unless `oversubscribe`."""

from __future__ import annotations

import os
from typing import Any


def split_problems(recipe: Any, i: int) -> list[str]:
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


def too_many_processes(stage: Any, where: str, ranks: int) -> list[str]:
    """A split over more processes than this machine's cores, unless the stage sets
    `oversubscribe` (shared by the tensor, pipeline and expert splits)."""
    cores = os.cpu_count() or 1
    if ranks <= cores or getattr(stage, "oversubscribe", False):
        return []
    return [f"{where}: {ranks} processes is more than the {cores} CPU cores of this machine; "
            f"use {cores} or fewer, or set oversubscribe: true to run them anyway (slower)"]


def split_fits_the_config(recipe: Any, i: int, config: dict[str, Any]) -> list[str]:
    """tensor_parallel divides the model's key-value heads and feed-forward neurons."""
    from serve.causal_lm.tensor_parallel import split_problem  # no torch import

    ranks = getattr(recipe.stages[i], "tensor_parallel", None)
    if not ranks or "intermediate_size" not in config:
        return []
    problem = split_problem(config, ranks)
    return [f"stages.{i}.{problem}"] if problem else []

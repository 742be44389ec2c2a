"""How the stages of a recipe connect (no torch import): which stage's output enters each
stage, the chain of models behind it, and the rules between stages, read off the specs."""

from __future__ import annotations

from typing import Any

from compress.recipe.registry import spec_of


def model_stage_index(recipe: Any, i: int) -> int | None:
    """Index of the stage whose model enters stage i (None: the recipe's model).

    Leaves (exports, packages) never hand on a model. A `source` option picks an earlier
    stage by index, name or kind (the latest one of that kind)."""
    source = getattr(recipe.stages[i], "source", None)
    if source is not None:
        return _find_source(recipe, i, source)
    for j in range(i - 1, -1, -1):
        if spec_of(recipe.stages[j].kind).makes_model:
            return j
    return None


def input_stage_index(recipe: Any, i: int) -> int | None:
    """Index of the stage whose output enters stage i: its model, or for a kind that takes
    an earlier stage's file, that stage (ValueError when there is none)."""
    spec = spec_of(recipe.stages[i].kind)
    if not spec.takes_model and spec.input_stage is not None:
        return spec.input_stage(recipe, i)
    return model_stage_index(recipe, i)


def model_chain(recipe: Any, i: int) -> list[int]:
    """Indexes of the model-making stages behind the model that enters stage i, in order."""
    chain: list[int] = []
    j = input_stage_index(recipe, i)
    while j is not None:
        if spec_of(recipe.stages[j].kind).makes_model:
            chain.append(j)
        j = input_stage_index(recipe, j)
    return chain[::-1]


def chain_precision(recipe: Any, i: int) -> str | None:
    """The numeric format of the model entering stage i ("int8"; None: as loaded)."""
    precision = None
    for j in model_chain(recipe, i):
        cfg = recipe.stages[j]
        precision = spec_of(cfg.kind).precision(cfg) or precision
    return precision


def _find_source(recipe: Any, i: int, source: str | int) -> int:
    text = str(source)
    earlier = [j for j in range(i) if spec_of(recipe.stages[j].kind).makes_model]
    if text.isdigit() and int(text) in earlier:
        return int(text)
    for j in reversed(earlier):
        if text in (recipe.stages[j].name, recipe.stages[j].kind):
            return j
    choices = ", ".join(f"{j} ({recipe.stages[j].name or recipe.stages[j].kind})"
                        for j in earlier) or "none"
    raise ValueError(f"source: '{source}' is not an earlier stage that makes a model "
                     f"(choices: {choices})")


def check_stage_order(recipe: Any) -> list[str]:
    """Every rule between stages, one line per problem: unique names, each kind's
    `needs_before` and `refused_before` over the chain of models it receives, and each
    kind's own check."""
    problems: list[str] = []
    names: set[str] = set()
    for i, stage in enumerate(recipe.stages):
        spec = spec_of(stage.kind)
        if stage.name and stage.name in names:
            problems.append(f"stages.{i}.name: '{stage.name}' is used twice")
        names.add(stage.name or stage.kind)
        try:
            chain = [recipe.stages[j] for j in model_chain(recipe, i)]
        except ValueError as exc:
            problems.append(f"stages.{i}.{exc}")
            continue
        kinds = {s.kind for s in chain}
        problems += [f"stages.{i}: a {stage.kind} stage needs a {needed} stage before it"
                     for needed in spec.needs_before if needed not in kinds]
        for refused in spec.refused_before:
            if refused in kinds:
                problems.append(
                    f"stages.{i}: a {stage.kind} stage cannot take the model of a {refused} "
                    f"stage; move it before the {refused} stage")
        if spec.check is not None:
            problems += spec.check(recipe, i)
    return problems


def used_splits(recipe: Any) -> list[str]:
    """The data splits a recipe reads: eval always, then those its stages declare."""
    splits = ["eval"]
    for stage in recipe.stages:
        for name in spec_of(stage.kind).splits(stage):
            if name not in splits:
                splits.append(name)
    return splits


def hardware_needed(recipe: Any) -> list[tuple[int, str]]:
    """(stage index, hardware name) for every stage that needs more than a CPU."""
    return [(i, need) for i, stage in enumerate(recipe.stages)
            for need in spec_of(stage.kind).needs(stage)]

"""`compress search`: a recipe run with its search stage's tolerance (and objective) set on
the command line, or with a search stage added when the recipe has none."""

from __future__ import annotations

from typing import Any

import click

from compress.errors import UserError
from compress.recipe.kinds.search import SearchConfig

SEARCH_KIND = SearchConfig.model_fields["kind"].default
OBJECTIVES = ("latency_b1", "latency_b8", "latency_real", "size")


def add_search_stage(raw: dict[str, Any], max_drop: float | None) -> dict[str, Any]:
    """`raw` with a search stage before its first leaf that archives an export (a
    package), else at the end, when it has none; unchanged when it has one."""
    from compress.recipe.kinds.package import PackageConfig

    stages = list(raw.get("stages") or []) if isinstance(raw, dict) else []
    if any(isinstance(s, dict) and s.get("kind") == SEARCH_KIND for s in stages):
        return raw
    if max_drop is None:
        raise UserError("the recipe has no search stage; give --max-drop POINTS to add one")
    package = PackageConfig.model_fields["kind"].default
    at = next((i for i, s in enumerate(stages)
               if isinstance(s, dict) and s.get("kind") == package), len(stages))
    stages.insert(at, {"kind": SEARCH_KIND, "max_accuracy_drop": max_drop})
    return {**raw, "stages": stages}


@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--max-drop", type=click.FloatRange(min=0, max=100), metavar="POINTS",
              help="Largest accuracy loss against the model entering the search, in points.")
@click.option("--objective", type=click.Choice(OBJECTIVES),
              help="What the winner minimises (default: the recipe's, else latency_b8).")
@click.option("--output-dir", help="Parent folder of the run folder (overrides output_dir).")
def search(recipe: str, overrides: tuple[str, ...], max_drop: float | None,
           objective: str | None, output_dir: str | None) -> None:
    """Run RECIPE with the fastest artifact within --max-drop points as its winner.

    \b
    The recipe's search stage takes --max-drop and --objective; a recipe without one gets
    a search stage after its last model stage (before its package stage, which then
    archives the winner). Trials are cached in the stage folder: a re-run with another
    tolerance reuses them, a killed search resumes after its last finished trial.

    \b
    Examples:
      compress search recipes/bert_search.yaml --max-drop 0.1
      compress search recipes/bert_finetune.yaml --max-drop 0.5 --objective latency_b1
    """
    from compress.recipe.schema import load_recipe

    def edit(raw: dict[str, Any]) -> dict[str, Any]:
        return add_search_stage(raw, max_drop)

    first = load_recipe(recipe, overrides, edit=edit)  # where the search stage is
    index = next(i for i, s in enumerate(first.stages) if s.kind == SEARCH_KIND)
    extra = [f"stages.{index}.max_accuracy_drop={max_drop}"] if max_drop is not None else []
    extra += [f"stages.{index}.objective={objective}"] if objective else []
    extra += [f"output_dir={output_dir}"] if output_dir else []
    parsed = load_recipe(recipe, list(overrides) + extra, check_sources=True, edit=edit)
    from compress.pipeline.loop import run_recipe

    run_dir = run_recipe(parsed)
    click.echo(f"run folder: {run_dir}")
    click.echo(f"search: {run_dir / f'{index:02d}-{SEARCH_KIND}' / 'section.md'}")

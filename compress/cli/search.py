"""`compress search`: a recipe run with its search stage's tolerance (and objective) set on
the command line, or with a search stage added when the recipe has none."""

from __future__ import annotations

from typing import Any

import click

from compress.errors import UserError
from compress.recipe.kinds.search import OBJECTIVES, SearchConfig

SEARCH_KIND = SearchConfig.model_fields["kind"].default


def add_search_stage(raw: dict[str, Any], budget: dict[str, float]) -> dict[str, Any]:
    """`raw` with a search stage held to `budget` ({"max_accuracy_drop": 0.5}) before its
    first leaf that archives an export (a package), else at the end, when it has none;
    unchanged when it has one."""
    from compress.recipe.kinds.package import PackageConfig

    stages = list(raw.get("stages") or []) if isinstance(raw, dict) else []
    if any(isinstance(s, dict) and s.get("kind") == SEARCH_KIND for s in stages):
        return raw
    if not budget:
        raise UserError("the recipe has no search stage; give --max-drop POINTS (a "
                        "classifier) or --min-fidelity COSINE (an embedding model) to add one")
    package = PackageConfig.model_fields["kind"].default
    at = next((i for i, s in enumerate(stages)
               if isinstance(s, dict) and s.get("kind") == package), len(stages))
    stages.insert(at, {"kind": SEARCH_KIND, **budget})
    return {**raw, "stages": stages}


@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--max-drop", type=click.FloatRange(min=0, max=100), metavar="POINTS",
              help="Largest accuracy loss against the model entering the search, in points.")
@click.option("--min-fidelity", type=click.FloatRange(min=0, max=1, min_open=True),
              metavar="COSINE", help="Embedding models: lowest mean cosine to the float "
              "model's embeddings.")
@click.option("--min-recall", type=click.FloatRange(min=0, max=1, min_open=True),
              metavar="RECALL", help="Embedding models: lowest recall@10 against the float "
              "model's neighbours.")
@click.option("--objective", type=click.Choice(list(OBJECTIVES)),
              help="What the winner minimises (default: the recipe's, else latency_b8).")
@click.option("--output-dir", help="Parent folder of the run folder (overrides output_dir).")
def search(recipe: str, overrides: tuple[str, ...], max_drop: float | None,
           min_fidelity: float | None, min_recall: float | None, objective: str | None,
           output_dir: str | None) -> None:
    """Run RECIPE with the fastest artifact within a quality budget as its winner: --max-drop
    points of accuracy (a classifier), --min-fidelity and --min-recall (an embedding model).

    \b
    The recipe's search stage takes the budget and --objective; a recipe without one gets
    a search stage after its last model stage (before its package stage, which then
    archives the winner). Trials are cached in the stage folder: a re-run with another
    tolerance reuses them, a killed search resumes after its last finished trial.

    \b
    Examples:
      compress search recipes/bert_search.yaml --max-drop 0.1
      compress search recipes/bert_finetune.yaml --max-drop 0.5 --objective latency_b1
      compress search recipes/embed_search.yaml --min-fidelity 0.995
    """
    from compress.recipe.schema import load_recipe

    budget = {key: value for key, value in (("max_accuracy_drop", max_drop),
                                            ("min_fidelity", min_fidelity),
                                            ("min_recall_at_10", min_recall))
              if value is not None}

    def edit(raw: dict[str, Any]) -> dict[str, Any]:
        return add_search_stage(raw, budget)

    first = load_recipe(recipe, overrides, edit=edit)  # where the search stage is
    index = next(i for i, s in enumerate(first.stages) if s.kind == SEARCH_KIND)
    extra = [f"stages.{index}.{key}={value}" for key, value in budget.items()]
    extra += [f"stages.{index}.objective={objective}"] if objective else []
    extra += [f"output_dir={output_dir}"] if output_dir else []
    parsed = load_recipe(recipe, list(overrides) + extra, check_sources=True, edit=edit)
    from compress.pipeline.loop import run_recipe

    run_dir = run_recipe(parsed)
    click.echo(f"run folder: {run_dir}")
    click.echo(f"search: {run_dir / f'{index:02d}-{SEARCH_KIND}' / 'section.md'}")

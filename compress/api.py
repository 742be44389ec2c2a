"""The Python API's conveniences over the pipeline's pieces (see `compress/__init__.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.data.datasets import DataBundle, Examples
from compress.models.bundle import ModelBundle
from compress.recipe.schema import Recipe, load_recipe


def run(recipe: Recipe | str | Path, overrides: list[str] | tuple[str, ...] = (),
        force: bool = False) -> Path:
    """Run a recipe (a `Recipe` or a file with `KEY=VALUE` overrides); its run folder."""
    from compress.pipeline.loop import run_recipe

    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, overrides, check_sources=True)
    return run_recipe(recipe, force=force)


def load_data(recipe: Recipe | str | Path) -> DataBundle:
    """Every split a recipe uses (`.splits["train" | "calibration" | "eval"]`)."""
    from compress.data.datasets import load_data as load
    from compress.recipe.sources import check_recipe_sources

    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe, check_sources=True)
    return load(recipe, check_recipe_sources(recipe)[1])


def load_model(source: str | Path, label_names: list[str] | None = None) -> ModelBundle:
    """A model saved by a stage (`runs/<name>/NN-<kind>/model`), or a Hugging Face
    classifier folder or id (with `label_names`, default two labels)."""
    from compress.models.folders import STRUCTURE, load_saved
    from compress.models.loading import load_model as build
    from compress.recipe.sources import resolve_model

    folder = Path(source)
    written_by_a_stage = ("model.json", "model.pt2", "causal_lm.json", STRUCTURE)
    if any((folder / name).is_file() for name in written_by_a_stage):  # models.save_model
        return load_saved(folder)  # a pruned model's shapes come from its structure.json
    names = label_names or ["0", "1"]
    return build(resolve_model(str(source)), names, [])


def score(model: ModelBundle, examples: Examples, batch_size: int = 64,
             max_length: int = 128) -> dict[str, Any]:
    """Accuracy and macro-F1 of a model (a bundle or an export) on labelled examples."""
    from compress.measure.evaluate import evaluate as score

    return score(model.model.eval(), examples, batch_size, model.tokenizer, max_length,
                 len(model.label_names))

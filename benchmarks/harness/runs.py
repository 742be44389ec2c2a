"""A finished run folder as the peer benchmarks read it: its manifest when every recipe
stage finished, and its recipe (recipe.yaml), with or without its stages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.errors import UserError
from compress.runfolder.records import Manifest, require_manifest


def check_finished(run_dir: Path) -> Manifest:
    """The manifest of a run whose every recipe stage finished, else a UserError."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such folder (a run folder is made by compress run "
                        f"RECIPE)")
    manifest = require_manifest(run_dir)
    wanted = len(manifest.recipe_stages())
    for i in range(wanted):
        entry = manifest.stages[i] if i < len(manifest.stages) else None
        if entry is None or not entry.finished_ok:
            state = entry.status if entry is not None else "not started"
            name = entry.name if entry is not None else manifest.recipe_stages()[i].get("kind")
            raise UserError(f"{run_dir}: unfinished run (stage {i} {name}: {state}); run its "
                            f"recipe again to finish it")
    return manifest


def eval_recipe(run_dir: Path) -> Any:
    """The run's recipe (recipe.yaml) without its stages: its data section, seed and
    evaluation settings, so `load_data` reads the eval split alone. (The stages are left
    out also because the recipe.yaml of runs made before compress wrote it as given, with
    every default filled in, does not validate again when it has export stages.)"""
    return _recipe(run_dir, with_stages=False)


def full_recipe(run_dir: Path) -> Any:
    """The run's recipe (recipe.yaml) with its stages, so `load_data` reads every split."""
    return _recipe(run_dir, with_stages=True)


def _recipe(run_dir: Path, with_stages: bool) -> Any:
    from compress.recipe.files import read_yaml
    from compress.recipe.schema import validate_raw

    raw = read_yaml(run_dir / "recipe.yaml")
    recipe, problems = validate_raw(raw if with_stages else {**raw, "stages": []})
    if recipe is None or problems:
        raise UserError([f"{run_dir / 'recipe.yaml'}: {p}" for p in problems or ["invalid"]])
    return recipe

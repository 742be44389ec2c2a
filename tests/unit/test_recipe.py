"""Recipe schema, overrides, interpolation, and every bad-input path of `compress validate/run`."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, digits_recipe, write_recipe
from pydantic import ValidationError

from compress.errors import UserError
from compress.recipe.files import apply_overrides, interpolate_env
from compress.recipe.schema import load_recipe

RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def test_overrides_set_nested_values_and_list_items() -> None:
    raw = {"stages": [{"kind": "finetune"}], "data": {"eval": {"split": "validation"}}}
    apply_overrides(raw, ["stages.0.max_steps=50", "data.eval.max_samples=200",
                          "evaluation.latency.batch_sizes=[1, 4]", "name=x"])
    assert raw["stages"][0]["max_steps"] == 50
    assert raw["data"]["eval"]["max_samples"] == 200
    assert raw["evaluation"]["latency"]["batch_sizes"] == [1, 4]
    assert raw["name"] == "x"


def test_bad_overrides_are_user_errors() -> None:
    with pytest.raises(UserError) as info:
        apply_overrides({"stages": [{"kind": "finetune"}]},
                        ["stages.3.max_steps=1", "novalue", "stages.x=1"])
    assert len(info.value.messages) == 3
    assert "index 3 out of range (the list has 1 items)" in info.value.messages[0]


def test_env_interpolation(monkeypatch) -> None:
    monkeypatch.setenv("RUNS_HOME", "/data/runs")
    monkeypatch.delenv("NOT_SET", raising=False)
    problems: list[str] = []
    out = interpolate_env({"a": "${RUNS_HOME}/x", "b": ["${NOT_SET:-fallback}"],
                           "c": "${NOT_SET}", "d": 3}, problems)
    assert out["a"] == "/data/runs/x" and out["b"] == ["fallback"] and out["d"] == 3
    assert problems == ["c: environment variable NOT_SET is not set "
                        "(set it, or write ${NOT_SET:-default})"]


def test_overrides_reach_the_validated_recipe(tmp_path: Path) -> None:
    path = write_recipe(tmp_path / "r.yaml", digits_recipe(tmp_path))
    recipe = load_recipe(path, ["stages.0.max_steps=7", "seed=3"])
    assert recipe.stages[0].max_steps == 7 and recipe.seed == 3
    with pytest.raises(ValidationError):  # frozen
        recipe.stages[0].max_steps = 8  # type: ignore[misc]



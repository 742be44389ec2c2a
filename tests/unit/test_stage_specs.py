"""The stage registry: every kind has a complete spec beside its config, and nothing
outside a kind's own modules names the kind."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from compress.recipe.registry import StageSpec, all_specs, import_function, stage_configs

REPO = Path(__file__).resolve().parents[2]
KINDS = ["finetune", "distill", "prune", "moefy", "quantize", "precision", "compile", "export",
         "search", "package"]


def test_every_kind_is_registered_in_listing_order() -> None:
    assert list(all_specs()) == KINDS
    assert list(stage_configs()) == KINDS


def test_the_kind_list_names_every_kind_module() -> None:
    from compress.recipe.kinds import KINDS as LISTED

    modules = {path.stem for path in (REPO / "compress" / "recipe" / "kinds").glob("*.py")}
    assert list(LISTED) == KINDS and set(LISTED) == modules - {"__init__"}


@pytest.mark.parametrize("kind", KINDS)
def test_every_trait_is_declared_and_resolves(kind: str) -> None:
    spec = all_specs()[kind]
    assert isinstance(spec, StageSpec) and spec.kind == kind
    assert spec.config.model_fields["kind"].default == kind
    assert spec.doc() and not spec.doc().startswith(" ")
    traits = {f.name for f in dataclasses.fields(StageSpec)}
    assert traits >= {"makes_model", "takes_model", "data_parallel", "measured", "reference",
                      "code_modules", "splits", "needs_before", "refused_before", "precision",
                      "runtime", "reload", "input_stage", "check", "check_model", "needs"}
    assert callable(import_function(spec.runner))  # the run function exists
    if spec.reload is not None:
        assert callable(import_function(spec.reload))
    for module in spec.code_modules:
        assert importlib.util.find_spec(module) is not None
    if not spec.takes_model:
        assert spec.input_stage is not None, "a kind that takes a file says which"
    assert set(spec.needs_before) | set(spec.refused_before) <= set(KINDS)
    default = spec.config.model_validate({"kind": kind, **_required(kind)})
    assert isinstance(spec.splits(default), tuple)
    assert isinstance(spec.runtime(default.model_dump(mode="json"), {}), str)


def _required(kind: str) -> dict:
    return {"distill": {"student": {"layers": 1}}, "export": {"format": "onnx"},
            "search": {"max_accuracy_drop": 0.5}}.get(kind, {})


def test_kind_modules_hold_the_kind_names() -> None:
    """`git grep '"package"\\|"export"'` finds kind names only in their own spec modules
    and the list of them (and the Python API's `export` function name, and the `export`
    package that code_digest reads)."""
    pattern = re.compile(r'"package"|"export"')
    found = [f"{path.relative_to(REPO)}:{n}:{line}"
             for folder in ("compress", "export", "serve", "benchmarks")
             for path in sorted((REPO / folder).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    allowed = re.compile(r"^compress/(recipe/kinds/(export|package|__init__)\.py|__init__\.py|"
                         r"runfolder/code_digest\.py:\d+:PROJECT = )")
    assert found and all(allowed.match(line) for line in found), found


def test_order_rules_come_from_the_specs(monkeypatch) -> None:
    """A kind that needs another before it, or refuses one, is checked over the chain of
    models it receives (leaves do not count), whatever the kind is called."""
    from types import SimpleNamespace

    from compress.recipe import registry as spec_module
    from compress.recipe.chain import check_stage_order
    from compress.recipe.kinds.finetune import FinetuneConfig

    fake = dataclasses.replace(all_specs()["finetune"], kind="polish", needs_before=("distill",),
                               refused_before=("prune",), order=99)
    monkeypatch.setitem(spec_module._REGISTRY, "polish", fake)

    def stage(kind, **extra):
        return SimpleNamespace(kind=kind, name=None, **extra)

    plain = SimpleNamespace(stages=[stage("finetune"), stage("polish")])
    assert check_stage_order(plain) == [
        "stages.1: a polish stage needs a distill stage before it"]
    student = SimpleNamespace(layers=1, layer_indices=None, factory=None)
    pruned = SimpleNamespace(stages=[stage("distill", student=student),
                                     stage("prune", method="unstructured"),
                                     stage("export", source=None, format="onnx"),
                                     stage("polish")])
    assert check_stage_order(pruned) == [
        "stages.3: a polish stage cannot take the model of a prune stage; move it before "
        "the prune stage"]
    assert FinetuneConfig().kind == "finetune"

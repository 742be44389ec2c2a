"""A stage's cache key holds the code it runs: the modules it imports (lazily too), read
from the sources without importing them; a change to that code runs the stage again, and a
change to code it cannot reach (the CLI) leaves it cached."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import digits_recipe, write_recipe

from compress.pipeline.loop import run_recipe
from compress.recipe.schema import load_recipe
from compress.runfolder import code_digest
from compress.runfolder.code_digest import module_closure


def test_the_closure_follows_lazy_and_relative_imports_within_the_project() -> None:
    closure = module_closure(["compress.stages.prune"])
    assert "compress.stages.prune" in closure and "compress.algorithms.pruning" in closure
    assert "compress" in closure and "compress.stages" in closure  # their __init__ run too
    assert "compress.cli.main" not in closure and "torch" not in closure
    assert module_closure(["not_a_project_module"]) == []


def _statuses(run_dir: Path) -> list[str]:
    return [s["status"] for s in json.loads((run_dir / "manifest.json").read_text())["stages"]]


def test_a_changed_stage_module_runs_the_stage_again(tmp_path: Path, monkeypatch) -> None:
    copy = tmp_path / "code" / "compress"  # the sources the keys read, to edit safely
    shutil.copytree(code_digest.module_file("compress").parent, copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    real = code_digest._package_dir
    monkeypatch.setattr(code_digest, "_package_dir",
                        lambda name: copy if name == "compress" else real(name))
    raw = digits_recipe(tmp_path / "runs", epochs=1)
    raw["stages"].append({"kind": "prune", "amount": 0.3})
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", raw))
    run_dir = run_recipe(recipe, echo=lambda _: None)
    assert _statuses(run_dir) == ["done", "done"]
    assert _statuses(run_recipe(recipe, echo=lambda _: None)) == ["cached", "cached"]

    assert (copy / "cli" / "main.py").is_file() and (copy / "stages" / "prune.py").is_file()
    with open(copy / "cli" / "main.py", "a") as out:  # not reachable from either stage
        out.write("\n# a comment\n")
    assert _statuses(run_recipe(recipe, echo=lambda _: None)) == ["cached", "cached"]
    with open(copy / "stages" / "prune.py", "a") as out:  # the prune stage's module
        out.write("\n# a comment\n")
    assert _statuses(run_recipe(recipe, echo=lambda _: None)) == ["cached", "done"]


def test_a_kernel_source_a_module_builds_is_part_of_its_digest() -> None:
    from compress.runfolder.files import sha256_file
    from serve import encoder_attention

    digests = code_digest.code_digests(["serve.encoder_attention"])
    source = encoder_attention.SOURCE
    assert f"serve.encoder_attention:{source.name} {sha256_file(source)}" in digests
    assert code_digest.native_sources(Path(encoder_attention.__file__)) == sorted(
        encoder_attention.SOURCES)  # the attention and the norm kernels

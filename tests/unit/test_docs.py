"""The documentation holds: `compress stages` lists nested options, every shell block in the
README and docs/ is tested or marked as needing what CI lacks, and names real commands."""

from __future__ import annotations

from pathlib import Path

from compress.cli.stages import describe_kinds, render_kinds

REPO = Path(__file__).resolve().parents[2]


def _options(kind: str) -> dict[str, dict]:
    return {o["name"]: o for o in describe_kinds(kind)[0]["options"]}


def test_stages_lists_the_items_of_a_list_of_sections() -> None:
    options = _options("search")
    for name in ("shapes[].layers", "shapes[].ffn", "shapes[].heads", "shapes[].teacher"):
        assert name in options, name
    assert options["shapes[].ffn"]["bounds"] == [">= 0", "< 1"]
    assert options["shapes[].teacher"]["default"] is True
    assert "  shapes[].layers " in render_kinds(describe_kinds("search"))


def test_stages_lists_the_allowed_items_of_a_list() -> None:
    candidates = _options("search")["candidates"]
    assert candidates["allowed"][:2] == ["pt2e_static_aoti", "pt2e_dynamic_aoti"]
    assert len(candidates["allowed"]) == 8
    assert "one of: pt2e_static_aoti, " in render_kinds(describe_kinds("search"))


def test_every_shipped_recipe_writes_under_compress_runs() -> None:
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        lines = [x for x in recipe.read_text().splitlines() if x.startswith("output_dir:")]
        assert lines == ["output_dir: ${COMPRESS_RUNS:-runs}"], recipe.name


def test_the_tensorrt_recipe_quotes_what_validate_prints(monkeypatch, data_dir: Path) -> None:
    from click.testing import CliRunner

    from compress.cli.main import cli

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    recipe = "recipes/bert_trt_fp16.yaml"
    done = CliRunner().invoke(cli, ["validate", recipe])
    comments = [x[1:].strip() for x in (REPO / recipe).read_text().splitlines()
                if x.startswith("#")]
    assert done.exit_code == 0, done.output
    note = [x for x in done.output.splitlines() if ": note: " in x]
    if note:  # a machine without a CUDA GPU: the comment quotes the note word for word
        assert note[0] in comments


def test_version_needs_no_distribution_named_compress(monkeypatch) -> None:
    """The distribution is compress-pipeline: `compress --version` must not look up
    `compress` (on PyPI an unrelated project), which a fresh install does not have."""
    import importlib.metadata as metadata

    from click.testing import CliRunner

    from compress.cli.main import cli

    real = metadata.version

    def version(name: str) -> str:
        if name == "compress":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", version)
    done = CliRunner().invoke(cli, ["--version"])
    project = (REPO / "pyproject.toml").read_text().split("[project]\n", 1)[1]
    assert done.exit_code == 0, done.output
    assert f'version = "{done.output.split()[-1]}"' in project.split("\n[")[0]
    assert project.startswith('name = "compress-pipeline"')

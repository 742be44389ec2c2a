"""The documentation holds: `compress stages` lists nested options, every shell block in the
README and docs/ is tested or marked as needing what CI lacks, and names real commands."""

from __future__ import annotations

import glob
import importlib.util
import json
import re
import shlex
from pathlib import Path

from click.testing import CliRunner

from compress.cli.main import cli
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
    assert len(candidates["allowed"]) == 10
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


# The documentation's shell blocks. Every ```bash (or sh, shell, console) block in the README
# and docs/ sits under a marker line:
#   <!-- tested: PATH -->          PATH is a test that runs the block: tests/unit/test_docs.py
#                                  runs its blocks here; any other test file names the page
#   <!-- not tested: needs WHAT --> what CI lacks: a network, a GPU, Java, two machines, an
#                                  hour of CPU, a finished run; say which test covers it
SHELL = ("bash", "sh", "shell", "console")
MARKER = re.compile(r"^<!-- (tested: (?P<test>\S+)|not tested: (?P<why>needs .+?)) -->$")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def doc_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def shell_blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line number, the marker line above the block or '', the block's text) per shell
    block of a page."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        if match.group(1) not in SHELL:
            continue
        before = [x for x in text[:match.start()].splitlines() if x.strip()]
        found.append((text[:match.start()].count("\n") + 1, before[-1] if before else "",
                      match.group(2)))
    return found


def marked(test: str) -> list[tuple[Path, str]]:
    """(page, block) for every block marked `tested: test`."""
    return [(page, block) for page in doc_pages() for _, line, block in shell_blocks(page)
            if (m := MARKER.match(line)) and m.group("test") == test]


def test_every_shell_block_is_tested_or_says_what_it_needs() -> None:
    bad = []
    for page in doc_pages():
        for number, line, _ in shell_blocks(page):
            where = f"{page.relative_to(REPO)}:{number}"
            m = MARKER.match(line)
            if m is None:
                bad.append(f"{where}: no <!-- tested: TEST --> or <!-- not tested: needs ... -->")
            elif m.group("test"):
                test = REPO / m.group("test")
                if not test.is_file():
                    bad.append(f"{where}: {m.group('test')} does not exist")
                elif test.name != "test_docs.py" and page.name not in test.read_text():
                    bad.append(f"{where}: {m.group('test')} does not read {page.name}")
    assert not bad, "\n".join(bad)
    assert len(marked("tests/unit/test_docs.py")) >= 4


def test_every_command_named_in_a_shell_block_exists() -> None:
    commands = set(cli.commands)
    code = [(page.name, re.sub(r"(^|\s)#.*$", "", line))  # comments left out
            for page in doc_pages() for _, _, block in shell_blocks(page)
            for line in block.splitlines()]
    named = {(name, word) for name, line in code
             for word in re.findall(r"(?:^|[;&|(]\s*|\s)compress (\w[\w-]*)", line)}
    assert {word for _, word in named} >= {"run", "serve", "validate", "report"}
    assert not [(page, word) for page, word in named if word not in commands], commands


def _run_line(line: str, cwd: Path) -> None:
    """Run one `compress ...` line of a block in-process: globs expanded in `cwd`, a
    `> FILE` redirect written there."""
    words = shlex.split(line, comments=True)
    if not words:
        return
    assert words[0] == "compress", f"only compress commands run here: {line}"
    out = None
    if ">" in words:
        at = words.index(">")
        words, out = words[:at], cwd / words[at + 1]
    args = [a for w in words[1:] for a in (sorted(glob.glob(w, root_dir=cwd))
                                           if any(c in w for c in "*?[") else [w])]
    done = CliRunner().invoke(cli, args)
    assert done.exit_code == 0, f"{line}\n{done.output}"
    assert done.output.strip(), line
    if out is not None:
        out.write_text(done.output)
        json.loads(out.read_text())


def test_the_blocks_marked_for_this_file_run(tmp_path: Path, monkeypatch,
                                               data_dir: Path) -> None:
    for folder in ("recipes", "docs"):
        (tmp_path / folder).symlink_to(REPO / folder)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    blocks = marked("tests/unit/test_docs.py")
    for _, block in blocks:
        for line in block.splitlines():
            _run_line(line, tmp_path)
    assert (tmp_path / "recipe.schema.json").is_file()


def test_every_example_recipe_in_docs_validates(monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    examples = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.yaml"))
    assert "docs/examples/digits_int8.yaml" in examples
    done = CliRunner().invoke(cli, ["validate", *examples])
    assert done.exit_code == 0, done.output


def test_the_generated_stage_reference_lists_every_option() -> None:
    spec = importlib.util.spec_from_file_location(
        "stage_reference", REPO / "docs" / "hooks" / "stage_reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = (REPO / "docs" / "reference" / "stages.md").read_text()
    text = hook.on_page_markdown(page, page=None)
    assert hook.MARKER not in text
    for kind in describe_kinds():
        assert f"## `{kind['kind']}`" in text
        for option in kind["options"]:
            assert f"| `{option['name']}` |" in text, option["name"]
    assert "| `pt2e_static_aoti` |" in text and "`shapes[].heads`" in text


def test_every_compress_environment_variable_is_in_the_table() -> None:
    table = (REPO / "docs" / "environment.md").read_text()
    read = set()
    for folder in ("compress", "export", "serve", "benchmarks", "tests"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".sh"):
                read |= set(re.findall(r"\b(COMPRESS_[A-Z][A-Z0-9_]*[A-Z0-9])\b",
                                       path.read_text(errors="replace")))
    assert {"COMPRESS_DATA_DIR", "COMPRESS_STATE_DIR"} <= read
    assert not sorted(v for v in read if f"`{v}`" not in table)


def test_every_path_the_docs_name_exists() -> None:
    path = re.compile(r"`((?:compress|export|serve|recipes|tests|benchmarks|docs)/[\w./-]*)`")
    missing = [(page.name, name) for page in doc_pages()
               for name in path.findall(page.read_text())
               if not (REPO / name).exists()]
    assert not missing


def test_the_readme_stays_short() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_the_serving_page_says_an_archive_is_code() -> None:
    """Serving a .mar runs its handler, its .pt2 libraries and its Inductor cache (issue 70,
    item 11): docs/serving.md says so in a section of its own, says to serve only archives
    one built or trusts, and why the weights are safe."""
    page = (REPO / "docs" / "serving.md").read_text()
    assert "\n## An archive is code\n" in page, "docs/serving.md: no 'An archive is code'"
    section = " ".join(page.split("\n## An archive is code\n", 1)[1].split("\n## ", 1)[0]
                       .split())
    for said in ("the handler file", "`serve/` package", "AOTInductor packages (`.pt2`)",
                 "shared library", "Inductor cache", "`pickle`", "TorchScript",
                 "serve only archives you built or whose builder you trust",
                 "weights_only=True", "safetensors", "never passes `trust_remote_code`"):
        assert said in section, said

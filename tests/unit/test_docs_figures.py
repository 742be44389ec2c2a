"""A figure the README or docs/ quote beside a results file's name is in that file.

Each sentence of README.md and docs/ that names `benchmarks/results/<file>` is read for its
decimal figures (3.39x, 67.6%, 16.92 ms; not integers, which are counts and dates as often
as figures, and not what sits in `code`), and each must appear in one of the files the
sentence names: the file as committed now, or, where the sentence names it "as of <commit>",
the file at that commit (a historical figure of a run the file no longer holds)."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# a results file's name, and the commit it is read at where the sentence gives one
LINK = re.compile(r"benchmarks/results/([\w.-]+\.(?:md|json))`?\)?(?: as of ([0-9a-f]{7,40}))?")
CODE = re.compile(r"`[^`]*`")
# a decimal figure: not a version (2.13.0), a path or a name's part (llm_int8.md, Q4_0)
FIGURE = re.compile(r"(?<![\w.:/-])(\d+\.\d+)(?!\.\d|[A-Za-wyz_/]|x\w)")
SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z*(\[])|;\s")


@cache
def _results_text(name: str, commit: str | None) -> str | None:
    """The results file's text, now or at `commit` (None where git cannot show it)."""
    if commit is None:
        path = ROOT / "benchmarks" / "results" / name
        return path.read_text() if path.is_file() else None
    done = subprocess.run(["git", "show", f"{commit}:benchmarks/results/{name}"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    return done.stdout if done.returncode == 0 else None


def quoted(text: str) -> list[tuple[str, list[tuple[str, str | None]], list[str]]]:
    """(sentence, the results files it names with their commits, its decimal figures) for
    each sentence of `text` that names a results file."""
    found = []
    for block in re.split(r"\n\s*\n", text):
        for sentence in SENTENCE.split(" ".join(block.split())):
            links = LINK.findall(sentence)
            if links:
                figures = FIGURE.findall(LINK.sub(" ", CODE.sub(" ", sentence)))
                found.append((sentence, [(n, c or None) for n, c in links], figures))
    return found


def in_text(figure: str, text: str) -> bool:
    """Whether `figure` is one of `text`'s numbers, or the start of one (279.31 of 279.312;
    not 1.29 inside 151.29)."""
    return re.search(rf"(?<![\d.]){re.escape(figure)}", text) is not None


def test_the_reader_finds_figures_and_their_files() -> None:
    text = ("Served (`benchmarks/results/serve.md` as of 3f79109): **1.47x**, p99 88.5 ms; "
            "torch 2.13.0 and `--lr 1.5` are not figures.\n\nNo file here: 9.99x.")
    ((sentence, links, figures),) = quoted(text)
    assert links == [("serve.md", "3f79109")] and figures == ["1.47", "88.5"]
    assert in_text("279.31", "ppl 279.312") and not in_text("1.29", "151.29 tok/s")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_figure_quoted_beside_a_results_file_is_in_it(doc: Path) -> None:
    missing = []
    for sentence, links, figures in quoted(doc.read_text()):
        texts = [_results_text(name, commit) for name, commit in links]
        if any(t is None for t, (_, c) in zip(texts, links, strict=True) if c is None):
            missing.append(f"names a results file that does not exist: {sentence[:160]}")
            continue
        if any(t is None for t in texts):  # no git history to read it at its commit
            continue
        body = "\n".join(texts)
        missing += [f"{figure} is not in {', '.join(n for n, _ in links)}: {sentence[:160]}"
                    for figure in figures if not in_text(figure, body)]
    assert not missing, "\n".join(missing)

"""mkdocs hook: the stage reference page is written at build time from the stage specs,
through the same `describe_kinds` that `compress stages --json` prints, so it cannot drift."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MARKER = "<!-- stage-reference -->"


def _cell(value: Any) -> str:
    """A table cell: code-formatted where it is a value, pipes escaped."""
    text = "" if value is None or value == "" else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _default(option: dict[str, Any]) -> str:
    if option["type"].startswith("section"):
        return "options below"
    if option["required"]:
        return "**required**"
    text = f"`{option['default']!r}`"
    if "default_in_section" in option:
        text += f" (`{option['default_in_section']!r}` in a written section)"
    return text


def _limits(option: dict[str, Any]) -> str:
    parts = []
    if option["allowed"]:
        parts.append("one of " + ", ".join(f"`{v}`" for v in option["allowed"]))
    parts += [f"`{b}`" for b in option["bounds"]]
    return "; ".join(parts)


def reference_markdown() -> str:
    """One section per stage kind: its doc, then a table of every option, nested ones
    (`section.option`, and `list[].option` for each item of a list of sections) included."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from compress.cli.stages import describe_kinds
    from compress.recipe.kinds.search import CANDIDATES

    lines: list[str] = []
    for kind in describe_kinds():
        lines += [f"## `{kind['kind']}`", "", kind["doc"], "",
                  "| option | type | default | allowed | what it does |",
                  "|---|---|---|---|---|"]
        for opt in kind["options"]:
            lines.append(f"| `{opt['name']}` | {_cell(opt['type'])} | {_cell(_default(opt))} "
                         f"| {_cell(_limits(opt))} | {_cell(opt['description'])} |")
        if kind["kind"] == "search":
            lines += ["", "The search's candidates (`candidates`):", "",
                      "| candidate | what it is | format |", "|---|---|---|"]
            lines += [f"| `{name}` | {_cell(what)} | {fmt} |"
                      for name, (what, fmt, *_rest) in CANDIDATES.items()]
        lines.append("")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Replace the marker of the reference page with the generated tables."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, reference_markdown())

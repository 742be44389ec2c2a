"""Child processes and the rounds that run them: every row of a peer table is measured in a
fresh process per round, `python -m benchmarks.<suite>.<child> SPEC_JSON`, which prints one
JSON line (its figures, or {"error": one line}); rounds alternate the order, so each row
takes as many forward as reverse positions.

A child may run in a peer's own environment, where neither compress nor this package is
installed: it finds `benchmarks` through PYTHONPATH, which holds the repository first."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.harness.paths import REPO

T = TypeVar("T")


def child_env(*paths: str | Path) -> dict[str, str]:
    """This process's environment with `paths` and the repository first on PYTHONPATH:
    what a `python -m benchmarks...` child needs in compress's environment or a peer's."""
    kept = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [*map(str, paths), str(REPO), *([kept] if kept else [])])}


def run_module(python: str | Path, module: str, spec: dict[str, Any],
               paths: tuple[str | Path, ...] = ()) -> dict[str, Any]:
    """The JSON line of `python -m module SPEC_JSON` (with `child_env(*paths)`), or
    {"error": one line}: compress's `run_json_child`, which passes on this process's
    environment, with PYTHONPATH set for the call."""
    from compress.report.rebench import run_json_child

    kept = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = child_env(*paths)["PYTHONPATH"]
    try:
        return run_json_child([str(python), "-m", module, json.dumps(spec)])
    finally:
        if kept is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = kept


def alternating(items: list[T], rounds: int) -> Iterator[tuple[int, T]]:
    """(round, item) of every round: the items in order in even rounds, reversed in odd
    ones."""
    for r in range(rounds):
        for item in items if r % 2 == 0 else items[::-1]:
            yield r, item


def record(item: dict[str, Any], figures: dict[str, Any]) -> None:
    """A round's figures appended to the row's `rounds`, or its error kept on the row."""
    if "error" in figures:
        item["error"] = figures["error"]
    else:
        item["rounds"].append(figures)

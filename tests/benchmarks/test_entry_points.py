"""Every benchmark is a module of the `benchmarks` package, run from the repository root as
`python -m benchmarks.<suite>.<module>`: each one with a `__main__` entry answers `--help`
(found by walking the package, so a new benchmark is covered), none edits `sys.path`, and
the suites keep to their layers (the harness imports no suite, no suite another)."""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import benchmarks
from benchmarks.harness.rounds import child_env, run_module

REPO = Path(__file__).resolve().parents[2]
MAIN = re.compile(r'^if __name__ == "__main__":', re.M)


def modules() -> dict[str, Path]:
    """Every module of the package (not the packages themselves): {name: file}."""
    found = {}
    for info in pkgutil.walk_packages(benchmarks.__path__, "benchmarks."):
        if not info.ispkg:
            found[info.name] = Path(importlib.util.find_spec(info.name).origin)
    return found


def entry_points() -> list[str]:
    """The modules with a `__main__` entry."""
    return sorted(name for name, path in modules().items() if MAIN.search(path.read_text()))


def test_the_walk_finds_the_suites_and_their_children() -> None:
    names = entry_points()
    assert len(names) >= 25
    for name in ("benchmarks.classifier.peers", "benchmarks.classifier.child",
                 "benchmarks.embedding.served", "benchmarks.causal_lm.llama_child",
                 "benchmarks.causal_lm.micro.decode", "benchmarks.headline.run",
                 "benchmarks.soak.run", "benchmarks.training.fsdp_resume",
                 "benchmarks.gpu.sparse24", "benchmarks.harness.gemm"):
        assert name in names, name
    assert "benchmarks.harness.spread" not in names  # a library module has no entry


@pytest.mark.parametrize("name", entry_points())
def test_every_benchmark_answers_help(name: str, monkeypatch, capsys) -> None:
    """`python -m NAME --help`, run in this process (each module's imports once): exit 0
    and a usage text, argparse's or a child's."""
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    environment = dict(os.environ)
    try:
        with pytest.raises(SystemExit) as done, warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    finally:  # a module's main may set defaults in os.environ (the data mirror)
        os.environ.clear()
        os.environ.update(environment)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and len(out.splitlines()) > 2, out


def test_no_benchmark_edits_sys_path() -> None:
    """Everything is imported as a package module; a path a child needs (a checkout given
    on the command line, the repository in a peer's environment) goes to its PYTHONPATH."""
    files = [*modules().values(), *(REPO / "benchmarks").rglob("*.sh")]
    edits = re.compile(r"sys\.path\s*(\.(insert|append|extend)\b|\[[^\]]*\]\s*=|\+=)")
    assert not [str(f.relative_to(REPO)) for f in files if edits.search(f.read_text())]


def test_a_child_finds_the_package_from_anywhere(tmp_path: Path) -> None:
    """A child run by a peer's own Python, from any folder, finds `benchmarks` through the
    PYTHONPATH the harness gives it (the repository first, after any path it names)."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.causal_lm.llama_child",
                           json.dumps({"mode": "no such mode"})], cwd=tmp_path,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1])["error"] == "KeyError: 'no such mode'"
    answer = run_module(sys.executable, "benchmarks.causal_lm.llama_child", {"mode": "nope"})
    assert answer == {"error": "KeyError: 'nope'"}
    assert child_env(tmp_path)["PYTHONPATH"].split(os.pathsep)[:2] == [str(tmp_path),
                                                                       str(REPO)]


FOREIGN_CHILDREN = ("benchmarks.classifier.openvino_child", "benchmarks.embedding.child",
                    "benchmarks.causal_lm.llama_child", "benchmarks.causal_lm.zentorch_child")


@pytest.mark.parametrize("name", FOREIGN_CHILDREN)
def test_a_peers_child_imports_no_project_code(name: str) -> None:
    """A child that a peer's own Python runs (no compress, no torch there) imports the
    standard library, numpy and the harness's standard-library modules alone."""
    code = (f"import json, sys; import {name}; print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('compress', 'serve', 'export', 'torch', 'transformers'))))")
    done = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd="/",
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == []

"""The compiled graphs shipped in a causal-LM archive (serve/causal_lm/server/compiled_graphs.py):
a worker uses them only where they were built for its CPU and torch, from a copy, and says
in one line why it compiles afresh where they were not."""

from __future__ import annotations

import json
import logging
import os

import pytest

from serve.causal_lm.server import compiled_graphs
from serve.handler_settings import HandlerSettings


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    folder = tmp_path / compiled_graphs.FOLDER
    (folder / compiled_graphs.INDUCTOR / "fxgraph").mkdir(parents=True)
    (folder / compiled_graphs.INDUCTOR / "fxgraph" / "entry").write_text("a graph")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return folder


def test_graphs_built_for_this_cpu_and_torch_are_used_from_a_copy(shipped) -> None:
    (shipped / compiled_graphs.TARGET).write_text(json.dumps(compiled_graphs.target()))
    assert compiled_graphs.use_shipped(shipped, None) == ({}, None,
                                                        "shipped compiled graphs used")
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert cache != str(shipped / compiled_graphs.INDUCTOR)  # a copy: the archive stays as is
    with open(os.path.join(cache, "fxgraph", "entry")) as entry:
        assert entry.read() == "a graph"


@pytest.mark.parametrize("change", ["cpu", "torch"])
def test_graphs_built_elsewhere_are_refused_in_one_line(shipped, caplog, change) -> None:
    built = compiled_graphs.target()
    if change == "cpu":
        built["cpu_flags"] = sorted(set(built["cpu_flags"]) | {"amx_tile", "avx512_fp16"})
    else:
        built["torch"] = "1.0.0"
    (shipped / compiled_graphs.TARGET).write_text(json.dumps(built))
    with caplog.at_level(logging.WARNING):
        said = compiled_graphs.use_shipped(shipped, None)
    assert said == ({}, None, "shipped graphs refused: compiling afresh")
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    [line] = [r.getMessage() for r in caplog.records]
    assert ("cpu_flags" in line and "lacks" in line) if change == "cpu" else "torch" in line


def test_an_archive_without_graphs_compiles_at_start(tmp_path) -> None:
    steps, prefill, said = compiled_graphs.use_shipped(tmp_path, None)
    assert steps == {} and prefill is None and said.startswith("no compiled graphs shipped")


def test_the_target_names_the_vector_flags_that_march_native_uses() -> None:
    flags = compiled_graphs.target()["cpu_flags"]
    assert flags == sorted(flags) and all(f.startswith(compiled_graphs.CPU_PREFIXES)
                                          for f in flags)
    assert "avx2" in flags or not os.path.exists("/proc/cpuinfo")


def test_graphs_built_for_another_cache_or_rows_are_refused_in_one_line(shipped,
                                                                        caplog) -> None:
    built = {"cache_len": 512, "rows": 8, "compile": "max-autotune"}
    (shipped / compiled_graphs.TARGET).write_text(json.dumps(
        compiled_graphs.target() | {"shapes": built}))
    assert compiled_graphs.use_shipped(shipped, None, HandlerSettings(**built)) == (
        {}, None, "shipped compiled graphs used")
    for change in ({"cache_len": 1024}, {"rows": 4}):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            said = compiled_graphs.use_shipped(shipped, None, HandlerSettings(**built | change))
        assert said == ({}, None, "shipped graphs refused: compiling afresh")
        [line] = [r.getMessage() for r in caplog.records]
        assert "were built for" in line and str(next(iter(change.values()))) in line

"""benchmarks/embedding/rerank.py's pure parts: the in-process table (pairs/s spread, the
product ratio to sentence-transformers' ONNX int8, the like-for-like ratio at the fixed
shape, fidelity), the served table and its ratios to infinity, row selection, the
arguments and the exits for a missing or non-reranker run, and the child's pair helpers.
No environment is built, no model loaded, no server started, nothing timed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.embedding import child, rerank, rerank_served
from benchmarks.embedding.rerank_table import (
    like_for_like,
    render_markdown,
    render_text,
    table_rows,
)
from compress.errors import UserError


def _item(name: str, rates: list[float], fixed_model: float | None = None, **extra) -> dict:
    rounds = [{"items_per_s": r, "fixed_ms": 20.0, "fixed_model_ms": fixed_model}
              for r in rates]
    return {"name": name, "runtime": f"runtime of {name}", "size_mb": 22.5,
            "rounds": rounds, **extra}


FIGURES = [
    _item("st_fp32", [100.0, 110.0], 40.0, peer=True, precision="fp32",
          quality={"score_max_abs_diff": 0.0, "kendall_tau": 1.0, "ndcg_at_10": 0.6}),
    _item("st_onnx", [150.0, 160.0], 30.0, peer=True, precision="fp32"),
    _item("st_onnx_int8", [200.0, 400.0, 300.0], 20.0, peer=True, precision="int8"),
    _item("fp32_onnx", [140.0], 30.0, precision="fp32"),
    _item("int8_onnx", [330.0, 360.0, 300.0], 10.0, precision="int8",
          quality={"score_max_abs_diff": 0.00208, "kendall_tau": 0.9782, "ndcg_at_10": 0.588}),
]


def test_rows_carry_the_spread_the_product_ratio_and_the_like_for_like_ratio():
    rows = {r["row"]: r for r in table_rows(FIGURES)}
    ours = rows["int8_onnx"]
    assert (ours["pps_min"], ours["pps_median"], ours["pps_max"]) == (300.0, 330.0, 360.0)
    assert ours["ratio_median"] == pytest.approx(330 / 300)
    assert ours["ratio_best"] == pytest.approx(360 / 400)
    assert ours["ratio_fixed_model"] == pytest.approx(2.0)  # 20 ms over 10 ms
    assert rows["st_onnx_int8"]["ratio_median"] == 1.0
    assert (ours["score_max_abs_diff"], ours["kendall_tau"], ours["ndcg_at_10"]) == (
        0.00208, 0.9782, 0.588)
    assert rows["fp32_onnx"]["kendall_tau"] is None  # no scores saved: no fidelity


def test_like_for_like_pairs_each_export_with_the_peer_of_its_precision():
    lines = like_for_like(table_rows(FIGURES))
    assert lines == ["fp32_onnx / st_onnx: model alone at b8x128 1.00x, pairs in at real "
                     "lengths 0.90x (median)",
                     "int8_onnx / st_onnx_int8: model alone at b8x128 2.00x, pairs in at "
                     "real lengths 1.10x (median)"]
    assert like_for_like(table_rows(FIGURES[3:])) == []  # no peer measured


def test_the_text_table_keeps_a_failed_row_and_says_why():
    rows = table_rows([*FIGURES, {"name": "st_onnx", "peer": True, "rounds": [],
                                  "error": "onnx environment: pip failed"}])
    text = render_text(rows)
    assert "st_onnx: failed: onnx environment: pip failed" in text
    assert text.splitlines()[0].split()[:2] == ["row", "runtime"]
    failed = next(line for line in text.splitlines() if line.startswith("st_onnx ")
                  and "failed" in line and "runtime" not in line)
    assert failed.split()[-1] == "-"


def test_the_markdown_names_the_cpu_the_command_and_the_reference():
    header = {"date": "2026-11-29", "command": "python -m benchmarks.embedding.rerank RUN",
              "cpu": {"cpu": "AMD EPYC", "family": "AuthenticAMD family 25 model 1 stepping 1",
                      "microarchitecture": "Zen 3", "flags": "avx2", "cores": 2},
              "versions": {"the peers' onnx environment": {"sentence-transformers": "5.7.0"}},
              "reference": "st_fp32", "tie_margin": 0.001, "pairs": 200, "queries": 40,
              "notes": ["a note"]}
    markdown = render_markdown(table_rows(FIGURES), header)
    assert ("- CPU: AMD EPYC; microarchitecture Zen 3 (AuthenticAMD family 25 model 1 "
            "stepping 1); 2 cores" in markdown) and "- flags: avx2" in markdown
    assert "`python -m benchmarks.embedding.rerank RUN`" in markdown
    assert "sentence-transformers 5.7.0" in markdown and "within 0.001" in markdown
    assert "| int8_onnx | runtime of int8_onnx | 0.00208 | 0.9782 |" in markdown
    assert "- like for like: int8_onnx / st_onnx_int8" in markdown and "- a note" in markdown


def _args(**given) -> argparse.Namespace:
    return argparse.Namespace(**{"no_peers": False, "rows": None, **given})


def test_rows_are_picked_by_name_and_the_reference_is_the_callers_to_add():
    exports = ["fp32_onnx", "int8_onnx"]
    assert rerank.chosen_rows(exports, _args(), Path("r")) == [*exports, *rerank.PEERS]
    assert rerank.chosen_rows(exports, _args(rows=["st_onnx_int8", "int8_onnx"]),
                              Path("r")) == ["int8_onnx", "st_onnx_int8"]
    assert rerank.chosen_rows(exports, _args(no_peers=True), Path("r")) == exports
    assert rerank.chosen_rows(exports, _args(rows=["st_onnx"]), Path("r")) == ["st_onnx"]


def test_an_unknown_row_or_nothing_to_time_is_a_user_error():
    with pytest.raises(UserError, match="no row named nope .choices: int8_onnx, st_fp32"):
        rerank.chosen_rows(["int8_onnx"], _args(rows=["nope"]), Path("r"))
    with pytest.raises(UserError, match="no finished export has a \"reranker\" block"):
        rerank.chosen_rows([], _args(), Path("r"))
    with pytest.raises(UserError, match="no row named st_fp32"):
        rerank.chosen_rows(["int8_onnx"], _args(no_peers=True, rows=["st_fp32"]), Path("r"))


@pytest.mark.parametrize(("argv", "message"), [
    (["RUN", "--rounds", "0"], "--rounds must be at least 1"),
    (["RUN", "--warmup", "-1"], "--warmup must be at least 0"),
    (["RUN", "--infinity", "torch,tensorrt"], "unknown infinity variant 'tensorrt'"),
    (["RUN", "--concurrency", "1,x"], "--concurrency '1,x': expected numbers like 1,8"),
    (["RUN", "--requests", "0"], "--requests must be at least 1"),
    (["RUN", "--engine", "vllm"], "argument --engine: invalid choice"),
    (["RUN", "--no-compress-server", "--infinity", ""], "no server to measure"),
])
def test_a_bad_argument_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as done:
        rerank.parse_args(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_defaults_parse_the_served_levels_and_variants():
    args = rerank.parse_args(["RUN"])
    assert (args.levels, args.variants, args.rounds) == ([1, 8], list(
        rerank_served.INFINITY_VARIANTS), 3)
    assert rerank.parse_args(["RUN", "--infinity", ""]).variants == []


def test_a_missing_or_non_reranker_run_exits_2_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COMPRESS_DATA_DIR", str(tmp_path))  # main's default, restored after
    assert rerank.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"name": "bert", "recipe": {"stages": []}, "model": {"task": "classification"},
         "stages": []}))
    assert rerank.main([str(tmp_path), "--no-served"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a reranker run (model task 'classification'" in err


def _served(name: str, kind: str, rounds: list[dict], **extra) -> dict:
    return {"key": name.replace(" ", "-"), "name": name, "kind": kind, "rounds": rounds,
            **extra}


def _level(concurrency: int, pairs_per_s: float, p50: float, errors: int = 0) -> dict:
    return {"concurrency": concurrency, "pairs_per_s": pairs_per_s, "latency_ms_p50": p50,
            "latency_ms_p99": 2 * p50, "errors": errors}


def test_served_rows_and_their_ratios_to_infinity():
    items = [
        _served("compress torchserve", "compress",
                [{"cold_start_s": 8.0, "rss_peak_bytes": 2**30,
                  "runs": [_level(1, 100.0, 50.0), _level(8, 300.0, 120.0)]},
                 {"cold_start_s": 6.0, "rss_peak_bytes": 2**29,
                  "runs": [_level(1, 120.0, 40.0), _level(8, 500.0, 100.0, errors=1)]}],
                quality={"score_max_abs_diff": 0.002081, "kendall_tau": 0.97}),
        _served("infinity torch", "infinity",
                [{"cold_start_s": 12.0, "runs": [_level(1, 50.0, 90.0), _level(8, 200.0, 300.0)]},
                 {"cold_start_s": 14.0, "runs": [_level(1, 70.0, 70.0), _level(8, 200.0, 320.0)]}]),
        _served("infinity optimum", "infinity", [], error="no ONNX files: build failed"),
        _served("infinity optimum-int8", "infinity",
                [{"error": "infinity-optimum-int8: the server exited with 1: boom"}]),
    ]
    rows, lines = rerank_served.table(items, argparse.Namespace(levels=[1, 8]))
    ours = {r["concurrency"]: r for r in rows if r["kind"] == "compress"}
    assert ours[8]["pairs_per_s"] == 400.0 and ours[8]["errors"] == 1
    assert (ours[1]["cold_start_s"], ours[1]["rss_mb"], ours[1]["kendall_tau"]) == (
        7.0, 1024, 0.97)
    assert lines == [
        "c1: the fastest infinity is infinity torch (60.0 pairs/s)",
        "c1: compress torchserve pairs/s / infinity torch 1.83x, p50 latency / the "
        "fastest's 0.56x",
        "c8: the fastest infinity is infinity torch (200.0 pairs/s)",
        "c8: compress torchserve pairs/s / infinity torch 2.00x, p50 latency / the "
        "fastest's 0.35x",
        "infinity optimum: failed: no ONNX files: build failed",
        "infinity optimum-int8: round 1 failed: infinity-optimum-int8: the server exited "
        "with 1: boom"]
    text = rerank_served.render_text(rows, lines)
    assert text.splitlines()[0].split()[:3] == ["server", "conc", "pairs/s"]
    assert "Kendall τ" in text.splitlines()[0]


def test_pairs_are_grouped_by_their_query_in_order():
    texts = ["q1", "q1", "q2", "q1"]
    docs = ["a", "b", "c", "d"]
    expected = [("q1", ["a", "b"]), ("q2", ["c"]), ("q1", ["d"])]
    assert rerank_served.by_query(texts, docs) == expected
    assert child._by_query([list(p) for p in zip(texts, docs, strict=True)]) == expected


def test_the_fixed_shape_is_a_batch_of_pairs_of_the_asked_length():
    pairs = child.fixed_pairs(8, 128)
    assert len(pairs) == 8 and pairs[0] == pairs[7]
    query, document = pairs[0]
    # [CLS] query [SEP] document [SEP], every word one token
    assert len(query.split()) + len(document.split()) + 3 == 128

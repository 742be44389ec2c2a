"""benchmarks/classifier/table.py: FLOPs of a forward (benchmarks/harness/flops.py), share
of the int8 peak, medians over rounds, each row's spread over the rounds and every round's
figure, the speed-ups over Optimum int8 by median and by best round, and the rendered
tables; benchmarks/harness/spread.py's shared helpers (no timing)."""

from __future__ import annotations

import math

import pytest

from benchmarks.classifier import table as peers_table
from benchmarks.harness import flops as encoder
from benchmarks.harness import spread as peers_spread

# a results header's CPU (benchmarks/harness/provenance.py)
ZEN4 = {"cpu": "AMD EPYC", "family": "AuthenticAMD family 25 model 17 stepping 1",
        "microarchitecture": "Zen 4", "flags": "avx2 avx512_bf16", "cores": 2}

MINILM = {"num_hidden_layers": 6, "hidden_size": 384, "intermediate_size": 1536,
          "num_attention_heads": 12, "model_type": "bert"}


def test_minilm_forward_is_about_23_gflop_at_8_by_128() -> None:
    flops = encoder.forward_flops(MINILM, 8, 128)
    assert flops == pytest.approx(23e9, rel=0.03)
    linear = 2 * 6 * (4 * 384 * 384 + 2 * 384 * 1536) * 8 * 128
    attention = 6 * 2 * 2 * 8 * 12 * 128 * 128 * 32
    assert flops == linear + attention
    # DistilBERT's key names give the same shapes
    distil = {"n_layers": 6, "dim": 384, "hidden_dim": 1536, "n_heads": 12}
    assert encoder.forward_flops(distil, 8, 128) == flops
    with pytest.raises(KeyError, match="num_hidden_layers"):
        encoder.forward_flops({"hidden_size": 8})


def test_pruned_shapes_count_only_the_work_left() -> None:
    """A structure.json (the shapes structured pruning left) takes its linears' [out, in]
    and attention modules' head counts over the config's: layer 0's feed-forward halved and
    layer 1's attention at 6 heads of 32 (its query, key and value 192 wide)."""
    structure = {"modules": {
        "bert.encoder.layer.0.intermediate.dense": [768, 384],
        "bert.encoder.layer.0.output.dense": [384, 768],
        **{f"bert.encoder.layer.1.attention.self.{n}": [192, 384]
           for n in ("query", "key", "value")},
        "bert.encoder.layer.1.attention.output.dense": [384, 192]},
        "attention_heads": {"bert.encoder.layer.1.attention.self": 6}}
    full = encoder.forward_flops(MINILM, 8, 128)
    tokens = 8 * 128
    ffn_saved = 2 * (2 * 384 * 768) * tokens
    attention_saved = 2 * (4 * 384 * 192) * tokens + 2 * 2 * 8 * 6 * 128 * 128 * 32
    assert encoder.forward_flops(MINILM, 8, 128, structure) == \
        full - ffn_saved - attention_saved
    # layer 10 is not layer 1; an empty structure changes nothing
    other = {"modules": {"encoder.layer.10.intermediate.dense": [8, 384]}}
    assert encoder.forward_flops(MINILM, 8, 128, other) == full
    assert encoder.forward_flops(MINILM, 8, 128, {}) == full


def test_peak_fraction_and_ratio() -> None:
    # 23 GFLOP in 50 ms is 460 GOP/s: 0.59 of a 775 GOP/s peak
    assert peers_table.peak_fraction(23e9, 50.0, 775.0) == pytest.approx(460 / 775)
    assert peers_table.peak_fraction(23e9, None, 775.0) is None
    assert peers_table.peak_fraction(None, 50.0, 775.0) is None
    assert peers_spread.ratio(60.0, 40.0) == 1.5
    assert peers_spread.ratio(60.0, None) is None and peers_spread.ratio(None, 4.0) is None
    assert peers_spread.ratio(2.0, 3.0) == 2 / 3 and peers_spread.ratio(2.0, 3.0, 4) == 0.6667


def test_median_over_rounds_takes_each_key_of_the_rounds_that_have_it() -> None:
    rounds = [{"latency_ms_b8": 10.0, "accuracy": 0.9, "pid": 11, "latency_threads": 2},
              {"latency_ms_b8": 30.0, "pid": 12, "latency_threads": 2},
              {"latency_ms_b8": 14.0, "pid": 13, "latency_threads": 2}]
    merged = peers_spread.median_over_rounds(rounds, peers_table.MEASURED)
    assert merged == {"latency_ms_b8": 14.0, "accuracy": 0.9, "pid": 11,
                      "latency_threads": 2}
    assert peers_spread.median_over_rounds(rounds[:2], peers_table.MEASURED)[
        "latency_ms_b8"] == 20.0
    assert peers_spread.median_over_rounds([], peers_table.MEASURED) == {}


def _artifacts() -> list[dict]:
    flops = encoder.forward_flops(MINILM)
    figures = {"fp32_onnx": (150.0, 170.0), "int8_aoti": (60.0, 56.0),
               "optimum_int8": (50.0, 58.0)}
    items = []
    for name, (first, second) in figures.items():
        items.append({"name": name, "runtime": f"rt {name}", "size_mb": 22.0, "flops": flops,
                      "rounds": [{"latency_ms_b1": 5.0, "latency_ms_b8": first,
                                  "latency_ms_b8_real": first / 4, "latency_ms_b1_real": 3.0,
                                  "accuracy": 0.8681},
                                 {"latency_ms_b1": 7.0, "latency_ms_b8": second,
                                  "latency_ms_b8_real": second / 4,
                                  "latency_ms_b1_real": 4.0}]})
    items.append({"name": "broken", "runtime": "rt", "size_mb": 1.0, "flops": None,
                  "rounds": [], "error": "RuntimeError: boom"})
    return items


def test_rows_divide_by_optimum_int8_and_the_int8_peak() -> None:
    rows = {r["artifact"]: r for r in peers_table.table_rows(_artifacts(), 775.0)}
    assert rows["optimum_int8"]["latency_ms_b8"] == 54.0
    assert rows["optimum_int8"]["speedup_b8"] == 1.0
    assert rows["optimum_int8"]["speedup_b8_best"] == 1.0
    assert rows["fp32_onnx"]["speedup_b8"] == pytest.approx(54.0 / 160.0, abs=1e-4)
    assert rows["int8_aoti"]["speedup_b8"] == pytest.approx(54.0 / 58.0, abs=1e-4)
    assert rows["int8_aoti"]["speedup_b8_real"] == pytest.approx(54.0 / 58.0, abs=1e-4)
    # by best round: Optimum's fastest (50 ms) / the row's fastest (56 ms)
    assert rows["int8_aoti"]["speedup_b8_best"] == pytest.approx(50.0 / 56.0, abs=1e-4)
    assert rows["int8_aoti"]["speedup_b8_real_best"] == pytest.approx(12.5 / 14.0, abs=1e-4)
    flops = encoder.forward_flops(MINILM)
    assert rows["int8_aoti"]["pct_int8_peak"] == pytest.approx(
        100 * flops / 0.058 / 775e9)
    assert rows["fp32_onnx"]["accuracy_pct"] == pytest.approx(86.81)
    assert rows["fp32_onnx"]["latency_ms_b1"] == 6.0
    assert rows["broken"]["error"] and rows["broken"]["pct_int8_peak"] is None
    without = peers_table.table_rows(_artifacts()[:2], None)  # no Optimum row, no peak
    assert all(r["speedup_b8"] is None and r["speedup_b8_best"] is None
               and r["pct_int8_peak"] is None for r in without)


def test_rows_keep_every_round_and_the_spread_of_the_latencies() -> None:
    """Three rounds, one slow: the median and the best ratio tell it apart from the max."""
    items = [{"name": "optimum_int8", "rounds": [{"latency_ms_b8": 20.0} for _ in range(3)]},
             {"name": "search", "rounds": [{"latency_ms_b8": 11.0, "latency_ms_b8_real": 4.0},
                                           {"latency_ms_b8": 30.0},  # no real-length figure
                                           {"latency_ms_b8": 10.0, "latency_ms_b8_real": 5.0}]},
             {"name": "broken", "rounds": [], "error": "boom"}]
    optimum, search, broken = peers_table.table_rows(items, None)
    assert search["latency_ms_b8_rounds"] == [11.0, 30.0, 10.0]  # in round order
    assert (search["latency_ms_b8_min"], search["latency_ms_b8_median"],
            search["latency_ms_b8_max"]) == (10.0, 11.0, 30.0)
    assert search["latency_ms_b8"] == search["latency_ms_b8_median"]
    assert search["latency_ms_b8_real_rounds"] == [4.0, 5.0]
    assert (search["latency_ms_b8_real_min"], search["latency_ms_b8_real_max"]) == (4.0, 5.0)
    assert search["speedup_b8"] == pytest.approx(20 / 11, abs=1e-4)
    assert search["speedup_b8_best"] == 2.0
    assert search["speedup_b8_real"] is None  # Optimum has no real-length figure here
    assert optimum["latency_ms_b8_min"] == optimum["latency_ms_b8_max"] == 20.0
    assert broken["latency_ms_b8_rounds"] == [] and broken["latency_ms_b8_min"] is None
    assert broken["speedup_b8"] is None and broken["speedup_b8_best"] is None
    text = peers_table.render_text([optimum, search, broken]).splitlines()
    head = text[0]
    for heading in ("b8x128 min", "b8x128 max", "b8 real min", "b8 real max",
                    "x faster b8x128 median", "x faster b8x128 best",
                    "x faster b8 real median", "x faster b8 real best"):
        assert heading in head
    assert "1.82" in text[2] and "2.00" in text[2] and "30.0" in text[2]


def test_markdown_has_one_row_per_artifact_with_its_numbers() -> None:
    rows = peers_table.table_rows(_artifacts(), 775.0)
    header = {"date": "2026-01-01", "run": "runs/bert_int8", "cpu": ZEN4,
              "command": "python -m benchmarks.classifier.peers runs/bert_int8",
              "versions": {"compress": {"torch": "2.13.0"}}, "rounds": 2, "iters": 15,
              "warmup": 3,
              "eval_size": 872,
              "gemm": {"fp32_gflops": 182.0, "bf16_gflops": 428.0, "int8_gops": 775.0}}
    text = peers_table.render_markdown(rows, header)
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # the heading and one row each
    by_name = {line.split(" | ")[0][2:]: line for line in table[1:]}
    assert set(by_name) == {"fp32_onnx", "int8_aoti", "optimum_int8", "broken"}
    cells = [c.strip() for c in by_name["fp32_onnx"].strip("|").split("|")]
    flops = encoder.forward_flops(MINILM)
    assert cells == ["fp32_onnx", "rt fp32_onnx", "6.0", "160.0", "150.0", "170.0", "40.0",
                     "37.5", "42.5", "3.5", "86.81", "22.0", f"{54 / 160:.2f}",
                     f"{50 / 150:.2f}", f"{13.5 / 40:.2f}", f"{12.5 / 37.5:.2f}",
                     f"{100 * flops / 0.16 / 775e9:.1f}"]
    assert "by median (the medians over rounds) and by best" in text
    assert "| broken | rt | failed |" in text and "broken: failed: RuntimeError: boom" in text
    assert "- flags: avx2 avx512_bf16" in text and "microarchitecture Zen 4" in text
    assert "`python -m benchmarks.classifier.peers runs/bert_int8`" in text.splitlines()[2]
    assert "int8 (the better kernel) 775.0 GOP/s" in text
    assert "rounds: 2" in text and "872 eval" in text
    plain = peers_table.render_text(rows).splitlines()
    assert plain[0].split()[:2] == ["artifact", "runtime"] and len(plain) == 1 + len(rows) + 1


def test_cells_print_missing_and_non_finite_as_a_dash() -> None:
    assert peers_spread.cell(None, 1) == "-" and peers_spread.cell(math.nan, 1) == "-"
    assert peers_spread.cell(1.234, 2) == "1.23" and peers_spread.cell(True, 1) == "-"


def test_a_latency_ratio_is_the_reference_over_the_row_by_median_and_by_min() -> None:
    row = peers_spread.spread([12.0, 10.0, 30.0], "ms")
    reference = peers_spread.spread([20.0, 24.0, 22.0], "ms")
    assert row == {"ms_min": 10.0, "ms_median": 12.0, "ms_max": 30.0}
    assert peers_spread.ratios(row, reference, "ms", lower_is_better=True) == (
        round(22 / 12, 4), 2.0)

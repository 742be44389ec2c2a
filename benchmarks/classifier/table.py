"""The arithmetic and the table of benchmarks/classifier/peers.py: the fraction of the int8
GEMM peak (FLOPs of one forward: benchmarks/harness/flops.py), medians over rounds, per row
the spread over the rounds (min, median, max) and every round's figure of the 8 x 128 and
the batch 8 real-length latency, the speed-ups over Optimum int8 by median and by best
round, text and Markdown rendering.

A round's figure is the median of that round's timed calls (one fresh process per artifact
per round); a row's figure is the median over the rounds. The spread, the per-round lists
and the two ratios come from benchmarks/harness/spread.py (shared with the embedding
tables).

Pure functions over plain numbers and dicts (no torch import), so unit tests check them
without timing anything (tests/benchmarks/test_classifier_table.py).
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness.flops import FLOPS_BATCH, SEQ_LEN
from benchmarks.harness.provenance import header_lines
from benchmarks.harness.spread import (
    grid,
    is_number,
    markdown_rows,
    median_over_rounds,
    ratios,
    spread,
)
from benchmarks.harness.spread import render_text as aligned_text

BATCHES = (1, 8)  # the fixed-length sweep: batch 1 and 8 at SEQ_LEN (128) tokens
REFERENCE = "optimum_int8"  # the speed-up columns divide this row's latency by a row's
B8, B8_REAL = f"latency_ms_b{FLOPS_BATCH}", f"latency_ms_b{FLOPS_BATCH}_real"
SPREAD = {B8: f"speedup_b{FLOPS_BATCH}",  # the latencies with a spread: their speed-ups
          B8_REAL: f"speedup_b{FLOPS_BATCH}_real"}

# (heading, key of a row, decimals); a figure without min / max / best is the median over
# the rounds, min and max are the fastest and the slowest round, "x faster ... median" and
# "... best" Optimum int8's median and best round over the row's (the `_best` keys)
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("b1 ms", "latency_ms_b1", 1),
    ("b8x128 ms", B8, 1),
    ("b8x128 min", f"{B8}_min", 1),
    ("b8x128 max", f"{B8}_max", 1),
    ("b8 real ms", B8_REAL, 1),
    ("b8 real min", f"{B8_REAL}_min", 1),
    ("b8 real max", f"{B8_REAL}_max", 1),
    ("b1 real ms", "latency_ms_b1_real", 1),
    ("accuracy %", "accuracy_pct", 2),
    ("size MB", "size_mb", 1),
    ("x faster b8x128 median", "speedup_b8", 2),
    ("x faster b8x128 best", "speedup_b8_best", 2),
    ("x faster b8 real median", "speedup_b8_real", 2),
    ("x faster b8 real best", "speedup_b8_real_best", 2),
    ("% int8 peak", "pct_int8_peak", 1),
)

def peak_fraction(flops: float | None, latency_ms: float | None,
                  peak_gops: float | None) -> float | None:
    """(flops / latency) / peak: the share of the int8 GEMM peak a forward reaches."""
    if not flops or not latency_ms or not peak_gops:
        return None
    return flops / (latency_ms / 1000) / (peak_gops * 1e9)


MEASURED = ("latency_ms_", "real_", "load_s", "eval_s")  # figures that vary by round


def table_rows(artifacts: list[dict[str, Any]], int8_peak_gops: float | None
               ) -> list[dict[str, Any]]:
    """One row per artifact, in order. Each artifact is {"name", "runtime", "rounds": [the
    child's figures per round], "size_mb", "flops", "peer"?, "error"?}; a row holds the
    medians over the rounds, accuracy in %, the share of the int8 peak, and for the 8 x 128
    and the batch 8 real-length latency (`SPREAD`) every round's figure in round order
    (`..._rounds`), their `_min`, `_median` and `_max`, and the speed-up over the
    `optimum_int8` artifact (Optimum's ms / the row's) by median (`speedup_b8`,
    `speedup_b8_real`) and by best round (`..._best`: Optimum's fastest round / the
    row's)."""
    rows = []
    for item in artifacts:
        rounds = item.get("rounds") or []
        row = {"artifact": item["name"], "runtime": item.get("runtime", ""),
               "size_mb": item.get("size_mb"), "flops": item.get("flops"),
               "flops_source": item.get("flops_source"), "error": item.get("error"),
               "peer": bool(item.get("peer")), "rounds": len(rounds),
               **median_over_rounds(rounds, MEASURED)}
        for key in SPREAD:
            figures = [r[key] for r in rounds if is_number(r.get(key))]
            row[f"{key}_rounds"] = figures
            row.update(spread(figures, key, digits=3))
        if row.get("accuracy") is not None:
            row["accuracy_pct"] = 100 * row["accuracy"]
        row["pct_int8_peak"] = _percent(peak_fraction(
            row["flops"], row.get(f"latency_ms_b{FLOPS_BATCH}"), int8_peak_gops))
        rows.append(row)
    reference = next((r for r in rows if r["artifact"] == REFERENCE), {})
    for key, speedup in SPREAD.items():
        for row in rows:
            row[speedup], row[f"{speedup}_best"] = ratios(row, reference, key,
                                                          lower_is_better=True)
    return rows


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else 100 * fraction


def render_text(rows: list[dict[str, Any]]) -> str:
    """The table as aligned plain text, then one line per failed artifact."""
    return aligned_text(rows, COLUMNS, "artifact")


def render_markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """The table as Markdown, under the results header (command, date, CPU, flags,
    versions, GEMM peaks: benchmarks/harness/provenance.py), the run and the rounds;
    footnotes say where each artifact's FLOPs come from."""
    head, body = grid(rows, COLUMNS, "artifact")
    lines = [
        "# compress artifacts and their peers (Optimum, OpenVINO), one invocation", "",
        *header_lines(header), f"- run: `{header.get('run', '?')}`",
        f"- rounds: {header.get('rounds', '?')} (each artifact in a fresh process per round, "
        f"alternating order; a figure is the median over rounds of each round's median, "
        f"min and max the fastest and the slowest round's); "
        f"iters {header.get('iters', '?')}, warmup {header.get('warmup', '?')}; accuracy "
        f"on {header.get('eval_size', '?')} eval sentences (first round); real lengths on "
        + (f"the first {header['real_limit']}" if header.get("real_limit") else "all of them"),
        "", *markdown_rows(head, body),
    ]
    lines += ["", f"b1 / b8x128: batch 1 and 8 at {SEQ_LEN} tokens; real: the eval "
              "sentences in order, each batch padded to its longest. ms: the median over "
              "rounds of each round's median; min / max: the fastest / the slowest round "
              "(every round's figure is in the JSON). x faster: Optimum int8's ms / the "
              "row's, at 8 x 128 and at batch 8 real lengths, by median (the medians over "
              "rounds) and by best (each one's fastest round). % int8 peak: FLOPs of one "
              "8 x 128 forward / b8x128 latency (median) / int8 GEMM peak."]
    if any((r.get("pct_int8_peak") or 0) > 100 for r in rows):
        lines.append("- above 100% of the int8 peak: attention's softmax and the layer norms "
                     "are not GEMMs, so only a model that skips work (pruned, or padded "
                     "less) can pass 100%; check the GEMM microbenchmark.")
    notes: dict[str, list[str]] = {}
    for row in rows:
        if row.get("flops_source"):
            notes.setdefault(row["flops_source"], []).append(row["artifact"])
    lines += [f"- {', '.join(names)}: {note}" for note, names in notes.items()]
    lines += [f"- {r['artifact']}: failed: {r['error']}" for r in rows if r.get("error")]
    return "\n".join(lines) + "\n"

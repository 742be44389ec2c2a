"""The table of benchmarks/embedding/peers.py: per row the spread of sentences/s over the rounds
(min, median, max), the ratios to sentence-transformers' ONNX int8 row by median and by
best, fidelity, recall@10, size and the share of the int8 GEMM peak; as text, Markdown and
a plot (sentences/s, the bar from the slowest to the fastest round, against fidelity:
compress's exports circles, the peers diamonds).

The spread, the two ratios and the text table are benchmarks/harness/spread.py's (shared
with the classifier's table). Pure functions over plain numbers and dicts (no torch import;
matplotlib only in the plot), unit-tested without timing anything
(tests/benchmarks/test_embedding.py).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness.provenance import header_lines
from benchmarks.harness.spread import (
    cell,
    grid,
    markdown_rows,
    ratios,
    spread,
)
from benchmarks.harness.spread import render_text as aligned_text
from compress.report.plot import pyplot, save_figure

REFERENCE = "st_onnx_int8"  # the ratio columns divide a row's sentences/s by this row's
QUALITY = ("fidelity", "fidelity_p1", "recall_at_10")

# (heading, key of a row, decimals)
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("fidelity", "fidelity", 4),
    ("fidelity p1", "fidelity_p1", 4),
    ("recall@10", "recall_at_10", 3),
    ("sent/s median", "sps_median", 1),
    ("sent/s min", "sps_min", 1),
    ("sent/s max", "sps_max", 1),
    ("x ST int8 median", "ratio_median", 2),
    ("x ST int8 best", "ratio_best", 2),
    ("size MB", "size_mb", 1),
    ("% int8 peak", "pct_int8_peak", 1),
    ("b8x128 ms", "fixed_ms", 2),
    ("% int8 peak b8x128", "pct_int8_peak_fixed", 1),
    ("b8x128 model ms", "fixed_model_ms", 2),
    ("% int8 peak b8x128 model", "pct_int8_peak_fixed_model", 1),
)


def peak_share(flops: float | None, sps: float | None, count: int | None,
               peak_gops: float | None) -> float | None:
    """% of the int8 GEMM peak: the pass's FLOPs over its time (count / sentences/s)."""
    if not flops or not sps or not count or not peak_gops:
        return None
    return round(100 * flops * sps / count / (peak_gops * 1e9), 2)


def table_rows(items: list[dict[str, Any]], flops: float | None = None,
               count: int | None = None, peak_gops: float | None = None,
               fixed_flops: float | None = None) -> list[dict[str, Any]]:
    """One row per item, in order. An item is {"name", "runtime", "rounds": [a child's
    figures per round, each with "items_per_s" and maybe "fixed_ms"], "quality":
    {fidelity...}, "size_mb", "peer", "error"?, "flops"?}; `flops` is one pass over the
    `count` texts (for the peak share), where the item has no "flops" of its own (the work
    its passes do); `fixed_flops` one call of the fixed shape (8 x 128)."""
    rows = []
    for item in items:
        rates = [r["items_per_s"] for r in item.get("rounds") or [] if r.get("items_per_s")]
        quality = item.get("quality") or {}
        row = {"row": item["name"], "runtime": item.get("runtime", ""),
               "peer": bool(item.get("peer")), "size_mb": item.get("size_mb"),
               "error": item.get("error"), "rounds": len(rates), **spread(rates, "sps"),
               **{k: quality.get(k) for k in QUALITY}}
        row["pct_int8_peak"] = peak_share(item.get("flops", flops), row["sps_median"], count,
                                          peak_gops)
        for key, share in (("fixed_ms", "pct_int8_peak_fixed"),
                           ("fixed_model_ms", "pct_int8_peak_fixed_model")):
            fixed = [r[key] for r in item.get("rounds") or [] if r.get(key)]
            row[key] = round(statistics.median(fixed), 3) if fixed else None
            row[share] = peak_share(fixed_flops, 1000 / row[key], 1, peak_gops) if fixed \
                else None
        rows.append(row)
    reference = next((r for r in rows if r["row"] == REFERENCE), {})
    for row in rows:
        row["ratio_median"], row["ratio_best"] = ratios(row, reference, "sps",
                                                        lower_is_better=False)
    return rows


def select(names: list[str], wanted: list[str] | None) -> tuple[list[str], list[str]]:
    """(the names `wanted` picks, in table order; the wanted names that are not rows)."""
    if not wanted:
        return list(names), []
    unknown = [w for w in wanted if w not in names]
    return [n for n in names if n in wanted], unknown


def render_text(rows: list[dict[str, Any]]) -> str:
    """The table as aligned plain text, then one line per failed row."""
    return aligned_text(rows, COLUMNS, "row")


def render_markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """The table as Markdown under the results header (command, date, CPU, flags, the
    versions of every environment, GEMM peaks: benchmarks/harness/provenance.py) and the
    protocol, with the notes and the failed rows under it."""
    head, body = grid(rows, COLUMNS, "row")
    lines = [
        "# Embedding models: compress's exports and their peers, one invocation", "",
        *header_lines(header), f"- run: `{header.get('run', '?')}`",
        f"- model: {header.get('model', '?')}; texts: {header.get('texts', '?')} "
        f"({header.get('source', '?')}), batch {header.get('batch', '?')}, mean padded "
        f"length {cell(header.get('mean_tokens'), 1)} tokens",
        f"- rounds: {header.get('rounds', '?')} (each row in a fresh process per round, "
        f"alternating order); each round the median of {header.get('passes', '?')} timed "
        f"passes after {header.get('warmup', '?')} untimed batches",
        *(["- GEMM peaks: benchmarks/harness/gemm.py, before and after the rounds, the "
           "better of the two; % int8 peak against the better int8 kernel"]
          if header.get("gemm") else []),
        "", *markdown_rows(head, body),
    ]
    lines += ["", "sent/s: texts in, embeddings out (tokenizing included, as a user calls "
              "each library), the texts in order in batches of the stated size; a peer runs a "
              "batch in one pass padded to its longest, compress's rows in passes of similar "
              "length (the served handlers' length_buckets; `one pass`: the same file "
              "without), or a packed file's batch in one pass of its real tokens only. "
              "fidelity: mean cosine with sentence-transformers fp32's embedding of the same "
              "text (p1: the 1st percentile); recall@10: the share of each text's 10 nearest "
              "texts under sentence-transformers fp32 kept. x ST int8: the row's sent/s over "
              f"{REFERENCE}'s, by median and by best (max) round. % int8 peak: the encoder FLOPs "
              "of the row's passes (its own shapes) / their time / the int8 GEMM peak. b8x128 "
              "ms: the median over rounds of a batch of 8 texts of 128 tokens (a round's "
              "figure is its median call); % int8 peak b8x128: that call's FLOPs over it. b8x128 "
              "model: the same batch tokenized once and the model alone called on it, as "
              "peers.py and the search time an encoder (sentence-transformers' forward after "
              "its tokenize; compress's exported program on the padded tensors; none for "
              "fastembed), and its share of the peak."]
    lines += [f"- {note}" for note in header.get("notes") or []]
    lines += [f"- {r['row']}: failed: {r['error']}" for r in rows if r.get("error")]
    return "\n".join(lines) + "\n"


def points_of(rows: list[dict[str, Any]], peer: bool) -> list[dict[str, Any]]:
    """The measured rows (sentences/s and fidelity both known) that are (not) peers."""
    return [r for r in rows if bool(r.get("peer")) == peer and r.get("sps_median")
            and r.get("fidelity") is not None]


def plot_rows(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Write the plot of sentences/s against fidelity; None without matplotlib or
    measured rows."""
    ours, peers = points_of(rows, peer=False), points_of(rows, peer=True)
    plt = pyplot() if ours or peers else None
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    for points, marker, color, label in ((ours, "o", "tab:blue", "compress exports"),
                                         (peers, "D", "tab:orange", "peers")):
        for i, row in enumerate(points):
            x, y = row["sps_median"], row["fidelity"]
            low, high = row.get("sps_min") or x, row.get("sps_max") or x
            ax.errorbar([x], [y], xerr=[[x - low], [high - x]], fmt=marker, color=color,
                        markersize=7, capsize=3, zorder=3)
            ax.annotate(row["row"], (x, y), textcoords="offset points", fontsize=7,
                        color=color, xytext=(6, 5 if i % 2 == 0 else -11))
        ax.scatter([], [], marker=marker, color=color, label=label)
    ax.set_xscale("log")
    from matplotlib.ticker import ScalarFormatter

    for axis in (ax.xaxis.set_major_formatter, ax.xaxis.set_minor_formatter):
        axis(ScalarFormatter())  # 200, not 2 x 10^2
    ax.set_xlabel("sentences/s at batch 32, real lengths (median round; bars: min to max)")
    ax.set_ylabel("fidelity (mean cosine with sentence-transformers fp32)")
    ax.set_title("embedding speed against fidelity, every row timed in one invocation",
                 fontsize=10)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(loc="lower left", fontsize=8)
    return save_figure(fig, path)

"""The table of benchmarks/embedding/rerank.py: per row the spread of pairs/s over the rounds
(min, median, max), the product ratio to sentence-transformers' ONNX int8 row by median and
by best, the like-for-like ratio (the model alone at one fixed shape), and fidelity to the
fp32 reference (largest score difference, Kendall's tau per query), with nDCG@10 against the
labels; as text and Markdown.

The spread, the ratios and the text table are benchmarks/harness/spread.py's. Pure
functions over plain numbers and dicts (no torch import), unit-tested without timing
anything (tests/benchmarks/test_rerank_peers.py).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.harness.provenance import header_lines
from benchmarks.harness.spread import (
    grid,
    markdown_rows,
    ratio,
    ratios,
    spread,
)
from benchmarks.harness.spread import render_text as aligned_text

REFERENCE = "st_onnx_int8"  # the ratio columns divide a row's figures by this row's
QUALITY = ("score_max_abs_diff", "kendall_tau", "ndcg_at_10")
LIKE = {"int8": "st_onnx_int8", "fp32": "st_onnx"}  # a row's like-for-like peer by precision

# (heading, key of a row, decimals)
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("max abs Δscore", "score_max_abs_diff", 5),
    ("Kendall τ", "kendall_tau", 4),
    ("nDCG@10", "ndcg_at_10", 4),
    ("pairs/s median", "pps_median", 1),
    ("pairs/s min", "pps_min", 1),
    ("pairs/s max", "pps_max", 1),
    ("x ST int8 median", "ratio_median", 2),
    ("x ST int8 best", "ratio_best", 2),
    ("b8x128 ms", "fixed_ms", 2),
    ("b8x128 model ms", "fixed_model_ms", 2),
    ("x ST int8 b8x128 model", "ratio_fixed_model", 2),
    ("size MB", "size_mb", 1),
)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def table_rows(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per item, in order. An item is {"name", "runtime", "rounds": [a child's
    figures per round, each with "items_per_s" and maybe "fixed_ms", "fixed_model_ms"],
    "quality": {score_max_abs_diff, kendall_tau, ndcg_at_10...}, "size_mb", "peer",
    "error"?}."""
    rows = []
    for item in items:
        rounds = item.get("rounds") or []
        rates = [r["items_per_s"] for r in rounds if r.get("items_per_s")]
        quality = item.get("quality") or {}
        row = {"row": item["name"], "runtime": item.get("runtime", ""),
               "peer": bool(item.get("peer")), "precision": item.get("precision"),
               "size_mb": item.get("size_mb"), "error": item.get("error"),
               "rounds": len(rates), **spread(rates, "pps"),
               **{k: quality.get(k) for k in QUALITY}}
        for key in ("fixed_ms", "fixed_model_ms"):
            row[key] = _median([r[key] for r in rounds if r.get(key)])
        rows.append(row)
    reference = next((r for r in rows if r["row"] == REFERENCE), {})
    for row in rows:
        row["ratio_median"], row["ratio_best"] = ratios(row, reference, "pps",
                                                        lower_is_better=False)
        row["ratio_fixed_model"] = ratio(reference.get("fixed_model_ms"),
                                         row.get("fixed_model_ms"), 4)
    return rows


def like_for_like(rows: list[dict[str, Any]]) -> list[str]:
    """Each of compress's rows against the peer of its precision (int8: ST's ONNX int8,
    fp32: ST's ONNX export; the same weights), model alone at the fixed shape and pairs in
    at real lengths, both as speed-ups (above 1: compress's row is faster)."""
    by_name = {r["row"]: r for r in rows}
    lines = []
    for row in rows:
        peer = by_name.get(LIKE.get(row.get("precision") or "", ""))
        if row["peer"] or peer is None:
            continue
        model = ratio(peer.get("fixed_model_ms"), row.get("fixed_model_ms"), 2)
        pairs = ratio(row.get("pps_median"), peer.get("pps_median"), 2)
        lines.append(f"{row['row']} / {peer['row']}: model alone at b8x128 "
                     f"{_shown(model)}, pairs in at real lengths {_shown(pairs)} (median)")
    return lines


def _shown(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def render_text(rows: list[dict[str, Any]]) -> str:
    """The table as aligned plain text, the like-for-like lines, one line per failed row."""
    lines = like_for_like(rows)
    return aligned_text(rows, COLUMNS, "row") + "".join(f"{line}\n" for line in lines)


def render_markdown(rows: list[dict[str, Any]], header: dict[str, Any]) -> str:
    """The table as Markdown under the results header (command, date, CPU, flags, the
    versions of every environment: benchmarks/harness/provenance.py) and the protocol, the
    like-for-like lines, the notes and the failed rows under it."""
    head, body = grid(rows, COLUMNS, "row")
    lines = [
        "# Rerankers: compress's exports and their peers, one invocation", "",
        *header_lines(header), f"- run: `{header.get('run', '?')}`",
        f"- model: {header.get('model', '?')}; pairs: {header.get('pairs', '?')} of "
        f"{header.get('queries', '?')} queries ({header.get('source', '?')}), batch "
        f"{header.get('batch', '?')} pairs",
        f"- rounds: {header.get('rounds', '?')} (each row in a fresh process per round, "
        f"alternating order); each round the median of {header.get('passes', '?')} timed "
        f"passes after {header.get('warmup', '?')} untimed batches",
        "", *markdown_rows(head, body), "",
    ]
    lines += [f"- like for like: {line}" for line in like_for_like(rows)]
    lines += ["", "pairs/s: (query, document) pairs in, scores out (tokenizing included, as "
              "a user calls each library: `CrossEncoder.predict`, or compress's export as its "
              "served handler reads a request), the pairs in order in batches of the stated "
              "size; sentence-transformers runs a batch in one pass padded to its longest, "
              "compress's rows in passes of similar length (the handler's length_buckets). "
              "max abs Δscore and Kendall τ: against the fp32 reference "
              f"({header.get('reference', '?')}) on the same pairs, τ per query averaged, "
              f"two documents within {header.get('tie_margin', '?')} of each other in the "
              "reference a near-tie and not counted; nDCG@10 against the pair set's labels. "
              f"x ST int8 (the product ratio): the row's pairs/s over {REFERENCE}'s, by median "
              "and by best (max) round. b8x128: 8 pairs of 128 tokens in one call (median of 15 "
              "calls a round, median over rounds), pairs in; model: the same batch tokenized "
              "once and the model alone called on it (the like-for-like shape), and x ST int8 "
              f"b8x128 model its speed-up over {REFERENCE}'s."]
    lines += [f"- {note}" for note in header.get("notes") or []]
    lines += [f"- {r['row']}: failed: {r['error']}" for r in rows if r.get("error")]
    return "\n".join(lines) + "\n"

"""The tables of benchmarks/embedding/peers.py: per row the spread of sentences/s over the
rounds (min, median, max), the product ratios to sentence-transformers' ONNX int8 row by
median and by best, fidelity, recall@10, size and the share of the int8 GEMM peak; then the
two ratios of each of compress's rows against each int8 peer (`two_ratios`): the product
ratio (against the peer on the user's model, each side's quality beside it) and the
like-for-like ratio (against the peer on the same weights, our student's, texts in at real
lengths and the model alone at 8 x 128); as text, Markdown and a plot (sentences/s, the
bar from the slowest to the fastest round, against fidelity: compress's exports circles,
the peers diamonds).

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
    aligned,
    cell,
    grid,
    markdown_rows,
    ratio,
    ratios,
    spread,
)
from benchmarks.harness.spread import render_text as aligned_text
from compress.report.plot import pyplot, save_figure

REFERENCE = "st_onnx_int8"  # the ratio columns divide a row's sentences/s by this row's
QUALITY = ("fidelity", "fidelity_p1", "recall_at_10")
RATIO_PEERS = ("st_onnx_int8", "st_openvino_int8", "fastembed_int8")  # the two ratios' peers
STUDENT = "student_"  # a peer's row on our student's weights (items.py's prefix)

# (heading, key of a row, decimals)
COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("fidelity", "fidelity", 4),
    ("fidelity p1", "fidelity_p1", 4),
    ("recall@10", "recall_at_10", 3),
    ("sent/s median", "sps_median", 1),
    ("sent/s min", "sps_min", 1),
    ("sent/s max", "sps_max", 1),
    ("product x ST int8 median", "ratio_median", 2),
    ("product x ST int8 best", "ratio_best", 2),
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
    {fidelity...}, "size_mb", "peer", "weights"?, "error"?, "flops"?, "fixed_flops"?};
    `flops` is one pass over the `count` texts (for the peak share), where the item has no
    "flops" of its own (the work its passes do); `fixed_flops` one call of the fixed shape
    (8 x 128), where the item has none of its own (a student's fewer layers)."""
    rows = []
    for item in items:
        rates = [r["items_per_s"] for r in item.get("rounds") or [] if r.get("items_per_s")]
        quality = item.get("quality") or {}
        row = {"row": item["name"], "runtime": item.get("runtime", ""),
               "peer": bool(item.get("peer")), "weights": item.get("weights"),
               "size_mb": item.get("size_mb"),
               "error": item.get("error"), "rounds": len(rates), **spread(rates, "sps"),
               **{k: quality.get(k) for k in QUALITY}}
        row["pct_int8_peak"] = peak_share(item.get("flops", flops), row["sps_median"], count,
                                          peak_gops)
        for key, share in (("fixed_ms", "pct_int8_peak_fixed"),
                           ("fixed_model_ms", "pct_int8_peak_fixed_model")):
            fixed = [r[key] for r in item.get("rounds") or [] if r.get(key)]
            row[key] = round(statistics.median(fixed), 3) if fixed else None
            row[share] = peak_share(item.get("fixed_flops", fixed_flops), 1000 / row[key], 1,
                                    peak_gops) if fixed else None
        rows.append(row)
    reference = next((r for r in rows if r["row"] == REFERENCE), {})
    for row in rows:
        row["ratio_median"], row["ratio_best"] = ratios(row, reference, "sps",
                                                        lower_is_better=False)
    return rows


# (heading, key of a two-ratios row, decimals); a None decimals is a text cell
RATIO_COLUMNS: tuple[tuple[str, str, int | None], ...] = (
    ("row", "row", None),
    ("against", "peer", None),
    ("product x (sent/s)", "product", 2),
    ("ours: fidelity / recall@10", "ours_quality", None),
    ("peer on the user's model: fidelity / recall@10", "peer_quality", None),
    ("like-for-like peer row", "like_row", None),
    ("like-for-like x texts in (sent/s)", "like_texts", 2),
    ("like-for-like x model alone (b8x128)", "like_model", 2),
    ("peer on the same weights: fidelity / recall@10", "like_quality", None),
)


def quality_cell(row: dict[str, Any] | None) -> str:
    """`0.9980 / 0.927`: a row's fidelity and recall@10, '-' for one not known."""
    if not row:
        return "-"
    return f"{cell(row.get('fidelity'), 4)} / {cell(row.get('recall_at_10'), 3)}"


def two_ratios(rows: list[dict[str, Any]], peers: tuple[str, ...] = RATIO_PEERS
               ) -> list[dict[str, Any]]:
    """For each of compress's measured rows and each of `peers` that has a row: the product
    ratio (the row's median sent/s over the peer's on the user's model, `name`) with both
    sides' fidelity and recall@10, and the like-for-like ratios against the peer on the same
    weights: `student_<name>` for an export of our student, the peer on the user's model for
    an export of the source's own weights, none for an export of other weights. Texts in:
    the medians of sent/s at real lengths; model alone: the peer's b8x128 model ms over the
    row's (both above 1 where ours is faster)."""
    by_name = {r["row"]: r for r in rows}
    out = []
    for ours in rows:
        if ours.get("peer") or not ours.get("sps_median"):
            continue
        for name in peers:
            weights = ours.get("weights") or "source"
            product = by_name.get(name)
            like = by_name.get({"source": name, "student": STUDENT + name}.get(weights, ""))
            if not product and not like:
                continue
            out.append({
                "row": ours["row"], "peer": name, "weights": weights,
                "product": ratio(ours["sps_median"], (product or {}).get("sps_median"), 4),
                "ours_quality": quality_cell(ours), "peer_quality": quality_cell(product),
                "like_row": like["row"] if like else "-",
                "like_texts": ratio(ours["sps_median"], (like or {}).get("sps_median"), 4),
                "like_model": ratio((like or {}).get("fixed_model_ms"),
                                    ours.get("fixed_model_ms"), 4),
                "like_quality": quality_cell(like)})
    return out


def ratio_cells(ratios_: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The two-ratios table's heading and printed cells."""
    head = [c[0] for c in RATIO_COLUMNS]
    body = [[str(r.get(key) or "-") if decimals is None else cell(r.get(key), decimals)
             for _, key, decimals in RATIO_COLUMNS] for r in ratios_]
    return head, body


RATIO_LEGEND = (
    "Two ratios, each above 1 where ours is faster. **product x**: the row's sent/s "
    "(median round) over the peer's on the user's model (the recipe's source, the "
    "teacher), each with its quality: what a user gains by running our chain's result "
    "instead of the peer on the model they brought. **like-for-like x**: against the same "
    "peer run on the same weights as the row (the float student our export was made from, "
    "saved as a sentence-transformers folder and exported by the peer's own tools: the "
    "`student_` rows; for an export of the source's own weights, the peer on the user's "
    "model), so both sides have the same architecture and shapes; **texts in** is sent/s "
    "at real lengths (each library's whole list in one call), **model alone** the peer's "
    "b8x128 model ms over the row's (8 texts of 128 tokens tokenized once; none for "
    "fastembed, which has no such call). The peer's fidelity / recall@10 on the same "
    "weights shows what the student costs before any int8.")


def select(names: list[str], wanted: list[str] | None) -> tuple[list[str], list[str]]:
    """(the names `wanted` picks, in table order; the wanted names that are not rows)."""
    if not wanted:
        return list(names), []
    unknown = [w for w in wanted if w not in names]
    return [n for n in names if n in wanted], unknown


def absent_lines(absent: list[dict[str, Any]] | None) -> list[str]:
    """One line per row that was not run: `NAME: not run: why`."""
    return [f"{a['name']}: not run: {a['reason']}" for a in absent or []]


def render_text(rows: list[dict[str, Any]], absent: list[dict[str, Any]] | None = None
                ) -> str:
    """The table as aligned plain text, one line per failed row, the two ratios, and one
    line per row not run."""
    text = aligned_text(rows, COLUMNS, "row")
    found = two_ratios(rows)
    if found:
        head, body = ratio_cells(found)
        text += "\n" + "\n".join(aligned([head, *body], 2)) + "\n"
    return text + "".join(f"{line}\n" for line in absent_lines(absent))


def render_markdown(rows: list[dict[str, Any]], header: dict[str, Any],
                    absent: list[dict[str, Any]] | None = None) -> str:
    """The table as Markdown under the results header (command, date, CPU, flags, the
    versions of every environment, GEMM peaks: benchmarks/harness/provenance.py) and the
    protocol, the two ratios with their legend, then the notes, the failed rows and the
    rows not run (one line each, with why)."""
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
    lines += ["", "sent/s: texts in, embeddings out (tokenizing included), each library "
              "given the whole list in one call with the stated batch size, as a user calls "
              "it (`encode(texts, batch_size=B)`): sentence-transformers sorts the list by "
              "length and pads each batch to its longest, fastembed takes the batches in "
              "order, compress's rows take the batches in order and run each in passes of "
              "similar length (the served handlers' length_buckets; `one pass`: the same "
              "file without), or a packed file's batch in one pass of its real tokens only. "
              "Rows named `student_...`: the peer on our student's weights (like for like). "
              "fidelity: mean cosine with sentence-transformers fp32's embedding of the same "
              "text (p1: the 1st percentile); recall@10: the share of each text's 10 nearest "
              "texts under sentence-transformers fp32 kept. product x ST int8: the row's sent/s "
              f"over {REFERENCE}'s (the peer on the user's model), by median and by best (max) "
              "round. % int8 peak: the encoder FLOPs of the row's passes (its own shapes, its "
              "own model's config: a student's fewer layers) / their time / the int8 GEMM "
              "peak. b8x128 "
              "ms: the median over rounds of a batch of 8 texts of 128 tokens (a round's "
              "figure is its median call); % int8 peak b8x128: that call's FLOPs over it. b8x128 "
              "model: the same batch tokenized once and the model alone called on it, as "
              "peers.py and the search time an encoder (sentence-transformers' forward after "
              "its tokenize; compress's exported program on the padded tensors; none for "
              "fastembed), and its share of the peak."]
    found = two_ratios(rows)
    if found:
        lines += ["", "## Two ratios: product and like for like", "",
                  *markdown_rows(*ratio_cells(found)), "", RATIO_LEGEND]
    lines += [""] if found else []
    lines += [f"- {note}" for note in header.get("notes") or []]
    lines += [f"- {r['row']}: failed: {r['error']}" for r in rows if r.get("error")]
    lines += [f"- {line}" for line in absent_lines(absent)]
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

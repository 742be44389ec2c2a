"""The arithmetic and the table of benchmarks/classifier/peers.py: the fraction of the int8
GEMM peak (FLOPs of one forward: benchmarks/harness/flops.py), medians over rounds, per row
the spread over the rounds (min, median, max) and every round's figure of the 8 x 128 and
the batch 8 real-length latency, the speed-ups over Optimum int8 (its fastest `--optimize`
level on the teacher) by median and by best round, the winner's two ratios to each peer at
its best (`headline`: the *product* ratio, the peer on the teacher, and the *like-for-like*
ratio, the peer on the winner's own student weights), text and Markdown rendering.

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
from benchmarks.harness.provenance import header_lines, scrubbed
from benchmarks.harness.spread import (
    cell,
    grid,
    is_number,
    markdown_rows,
    median_over_rounds,
    ratios,
    spread,
)
from benchmarks.harness.spread import render_text as aligned_text

BATCHES = (1, 8)  # the fixed-length sweep: batch 1 and 8 at SEQ_LEN (128) tokens
REFERENCE = "optimum_int8"  # the speed-up columns divide this peer's latency (its fastest
# --optimize level, on the teacher) by a row's
OPENVINO = "openvino_int8"
PEER_KINDS = {REFERENCE: "Optimum int8", OPENVINO: "OpenVINO int8 static"}  # the headline's
# whose weights a peer row ran -> the winner's ratio to it
SIDES = {"teacher": "product", "student": "like for like"}
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
        kind = item.get("peer_kind") or (item["name"] if item["name"] in PEER_KINDS else None)
        row = {"artifact": item["name"], "runtime": item.get("runtime", ""),
               "size_mb": item.get("size_mb"), "flops": item.get("flops"),
               "flops_source": item.get("flops_source"), "error": item.get("error"),
               "peer": bool(item.get("peer")), "peer_kind": kind,
               "peer_of": item.get("peer_of") or ("teacher" if kind else None),
               "level": item.get("level"), "winner": bool(item.get("winner")),
               "rounds": len(rounds), **median_over_rounds(rounds, MEASURED)}
        for key in SPREAD:
            figures = [r[key] for r in rounds if is_number(r.get(key))]
            row[f"{key}_rounds"] = figures
            row.update(spread(figures, key, digits=3))
        if row.get("accuracy") is not None:
            row["accuracy_pct"] = 100 * row["accuracy"]
        row["pct_int8_peak"] = _percent(peak_fraction(
            row["flops"], row.get(f"latency_ms_b{FLOPS_BATCH}"), int8_peak_gops))
        rows.append(row)
    for key, speedup in SPREAD.items():
        reference = fastest(rows, REFERENCE, "teacher", key) or {}
        for row in rows:
            row[speedup], row[f"{speedup}_best"] = ratios(row, reference, key,
                                                          lower_is_better=True)
    return rows


def fastest(rows: list[dict[str, Any]], kind: str, side: str, key: str
            ) -> dict[str, Any] | None:
    """The peer at its best: of the rows of peer `kind` on `side`'s weights (Optimum's int8
    at each --optimize level), the one with the smallest median `key` latency."""
    found = [r for r in rows if r.get("peer_kind") == kind and r.get("peer_of") == side
             and is_number(r.get(f"{key}_median"))]
    return min(found, key=lambda r: r[f"{key}_median"], default=None)


def headline(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The winner's two ratios to each peer at its best (`fastest`, per length): the
    *product* ratio against the peer on the teacher (the user's model) and the
    *like-for-like* ratio against the peer on the winner's own student weights, by median
    and by best round, at 8 x 128 and at batch 8 real lengths, with both accuracies and
    the peer's rows (levels) taken. None when no row is the winner."""
    winner = next((r for r in rows if r.get("winner")), None)
    if winner is None:
        return []
    found = []
    for side, name in SIDES.items():
        for kind, label in PEER_KINDS.items():
            entry: dict[str, Any] = {"ratio": name, "peer": label, "on": side,
                                     "winner": winner["artifact"],
                                     "winner_accuracy_pct": winner.get("accuracy_pct")}
            chosen = {key: fastest(rows, kind, side, key) for key in SPREAD}
            for key, speedup in SPREAD.items():
                entry[speedup], entry[f"{speedup}_best"] = ratios(
                    winner, chosen[key] or {}, key, lower_is_better=True)
            first = chosen[B8] or chosen[B8_REAL]
            entry["peer_rows"] = {key: r["artifact"] for key, r in chosen.items() if r}
            entry["peer_accuracy_pct"] = first.get("accuracy_pct") if first else None
            levels = [r.get("level") for r in chosen.values() if r and r.get("level")]
            entry["level"] = " / ".join(dict.fromkeys(levels)) or None
            found.append(entry)
    return found


# the headline's columns: (heading, key, decimals; None: a text)
HEADLINE: tuple[tuple[str, str, int | None], ...] = (
    ("ratio", "ratio", None), ("peer", "peer", None), ("on", "on", None),
    ("level", "level", None), ("peer accuracy %", "peer_accuracy_pct", 2),
    ("winner accuracy %", "winner_accuracy_pct", 2),
    ("x b8x128 median", "speedup_b8", 2), ("x b8x128 best", "speedup_b8_best", 2),
    ("x b8 real median", "speedup_b8_real", 2), ("x b8 real best", "speedup_b8_real_best", 2),
)


def headline_grid(entries: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The headline as a heading and rows of cells ("not measured" where no peer row ran)."""
    head = [c[0] for c in HEADLINE]
    body = []
    for entry in entries:
        measured = bool(entry.get("peer_rows"))
        body.append([(str(entry.get(key) or "-") if decimals is None
                      else cell(entry.get(key), decimals) if measured or key.startswith("winner")
                      else "not measured") for _, key, decimals in HEADLINE])
    return head, body


def headline_legend(entries: list[dict[str, Any]], student: dict[str, Any] | None) -> list[str]:
    """What the headline's two ratios compare, and whose weights the student's are."""
    if not entries:
        return []
    winner = entries[0]["winner"]
    student = student or {}
    whose = (f"`{student['folder']}` ({student['how']})" if student.get("folder")
             else f"not measured: {student['none']}" if student.get("none") else "?")
    return [
        f"The winner (`{winner}`, the chain's result) against each peer at its best, two "
        "ratios. **product**: the peer applied to the user's model, the fine-tuned teacher "
        "(what a user runs instead of compress), each side with its own accuracy. **like for "
        "like**: the peer applied to the same float student weights the winner was made "
        "from, so both sides run the same weights and shapes and the ratio is the runtime's "
        "and the quantizer's alone. x: the peer's ms / the winner's (above 1: the winner is "
        "faster), at 8 x 128 and at batch 8 real lengths, by median over the rounds and by "
        "each one's best round. Optimum int8: ONNX Runtime dynamic int8 (optimum-cli "
        "onnxruntime quantize --avx512_vnni) of the export at each `--optimize` level, the "
        "fastest level taken at each length (level: at 8 x 128 / at real lengths where they "
        "differ; peer accuracy: the level taken at 8 x 128); OpenVINO int8 static: NNCF's "
        "post-training int8 of Optimum's fp32 export of the same weights, calibrated on the "
        "calibration split.",
        f"- the winner's student weights: {whose}"]


def _percent(fraction: float | None) -> float | None:
    return None if fraction is None else 100 * fraction


def render_text(rows: list[dict[str, Any]]) -> str:
    """The table as aligned plain text, then one line per failed artifact, then the
    winner's two ratios to each peer (`headline`)."""
    text = aligned_text(rows, COLUMNS, "artifact")
    head, body = headline_grid(headline(rows))
    if not body:
        return text
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 4 else c.rjust(w)
                       for i, (c, w) in enumerate(zip(line, widths, strict=True))).rstrip()
             for line in [head, *body]]
    return text + "\nthe winner against each peer at its best:\n" + "\n".join(lines) + "\n"


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
        *([f"- Optimum int8: optimum-cli export onnx --optimize "
           f"{', '.join(header['optimum_levels'])}, each quantized to dynamic int8 and timed "
           "as a row of its own; the ratios take the fastest at each length"]
          if header.get("optimum_levels") else []),
        *[f"- Optimum int8 `{name}` not built, so not timed: {scrubbed(why)}"
          for name, why in sorted((header.get("optimum_failed") or {}).items())],
    ]
    entries = headline(rows)
    if entries:
        lines += ["", "## The winner against each peer: the product and the like-for-like "
                  "ratio", "", *markdown_rows(*headline_grid(entries)), "",
                  *headline_legend(entries, header.get("student")), "",
                  "## Every row"]
    lines += ["", *markdown_rows(head, body)]
    lines += ["", f"b1 / b8x128: batch 1 and 8 at {SEQ_LEN} tokens; real: the eval "
              "sentences in order, each batch padded to its longest. ms: the median over "
              "rounds of each round's median; min / max: the fastest / the slowest round "
              "(every round's figure is in the JSON). x faster: Optimum int8's ms (its "
              "fastest --optimize level on the teacher, at each length) / the "
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

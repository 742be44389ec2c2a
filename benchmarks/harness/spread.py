"""What the peer tables share (benchmarks/classifier/table.py, embedding/table.py and
served_table.py, causal_lm/table.py, classifier/plain_pair.py): the medians over the rounds,
a figure's spread over the rounds (min, median, max), the ratios of a row to the reference
row by median and by best round, the printed cells, and the table as aligned plain text.

A row's figure per round is that round's median (one fresh process per row per round); the
spread is over those figures. The ratio by median divides the medians over rounds, the
ratio by best divides each row's best round (the fastest: the smallest latency, the largest
rate), so a ratio that one slow round moved shows as a gap between the two.

Pure functions over plain numbers and dicts (no torch import), unit-tested in
tests/benchmarks/test_classifier_table.py and tests/benchmarks/test_embedding.py without
timing anything.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

RATIO_DIGITS = 4  # the ratios kept in the rows (and the JSON)


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def cell(value: Any, decimals: int) -> str:
    """A figure as printed: fixed decimals, '-' when missing or not finite."""
    if not is_number(value) or not math.isfinite(value):
        return "-"
    return f"{value:.{decimals}f}"


def ratio(value: float | None, reference: float | None,
          digits: int | None = None) -> float | None:
    """value / reference, rounded to `digits` when given (None when either is missing or
    the reference is 0)."""
    if value is None or not reference:
        return None
    return value / reference if digits is None else round(value / reference, digits)


def median_over_rounds(rounds: list[dict[str, Any]], measured: tuple[str, ...]
                       ) -> dict[str, Any]:
    """Per key that starts with one of the `measured` prefixes, the median of the rounds'
    numbers (over the rounds that have it: accuracy is first-round only); other values
    (pid, threads...) are the first round's that has them."""
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in rounds for k in r):
        values = [r[key] for r in rounds if key in r]
        if key.startswith(measured) and all(is_number(v) for v in values):
            merged[key] = round(statistics.median(values), 3)
        else:
            merged[key] = values[0]
    return merged


def spread(values: list[float], prefix: str, digits: int = 2) -> dict[str, float | None]:
    """`{prefix}_min`, `{prefix}_median` and `{prefix}_max` of the rounds' figures (None
    each when there are none)."""
    if not values:
        return {f"{prefix}_{name}": None for name in ("min", "median", "max")}
    return {f"{prefix}_min": round(min(values), digits),
            f"{prefix}_median": round(statistics.median(values), digits),
            f"{prefix}_max": round(max(values), digits)}


def ratios(row: dict[str, Any], reference: dict[str, Any], prefix: str,
           lower_is_better: bool) -> tuple[float | None, float | None]:
    """(by median, by best) of `row` against `reference` from their `spread(..., prefix)`
    keys, oriented so that above 1 the row is faster: for a latency (`lower_is_better`)
    the reference's figure over the row's, for a rate the row's over the reference's. The
    best round is the min of a latency and the max of a rate."""
    best = "min" if lower_is_better else "max"
    found = []
    for key in ("median", best):
        own, ref = row.get(f"{prefix}_{key}"), reference.get(f"{prefix}_{key}")
        found.append(ratio(ref, own, RATIO_DIGITS) if lower_is_better
                     else ratio(own, ref, RATIO_DIGITS))
    return found[0], found[1]


def grid(rows: list[dict[str, Any]], columns: tuple[tuple[str, str, int], ...],
         name: str) -> tuple[list[str], list[list[str]]]:
    """The heading and the printed cells: each row's `name` and runtime, then `columns`
    ((heading, key of a row, decimals)); a row that failed before any round reads
    'failed'."""
    head = [name, "runtime", *(c[0] for c in columns)]
    body = []
    for row in rows:
        if row.get("error") and not row.get("rounds"):
            figures = ["failed"] + ["-"] * (len(columns) - 1)
        else:
            figures = [cell(row.get(key), decimals) for _, key, decimals in columns]
        body.append([row[name], row.get("runtime") or "", *figures])
    return head, body


def render_text(rows: list[dict[str, Any]], columns: tuple[tuple[str, str, int], ...],
                name: str) -> str:
    """The table as aligned plain text (names and runtimes left, figures right), then one
    line per failed row."""
    head, body = grid(rows, columns, name)
    lines = aligned([head, *body], 2)
    lines += [f"{r[name]}: failed: {r['error']}" for r in rows if r.get("error")]
    return "\n".join(lines) + "\n"


def aligned(lines: list[list[str]], left: int) -> list[str]:
    """Rows of cells as aligned text: the first `left` columns left-aligned, the rest
    right-aligned, two spaces apart."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w)
                      for i, (c, w) in enumerate(zip(line, widths, strict=True))).rstrip()
            for line in lines]


def markdown_rows(head: list[str], body: list[list[str]]) -> list[str]:
    """A table's Markdown lines: the heading, the rule, a line a row."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(row) + " |" for row in body)]


def flags_said(flags: dict[str, Any], names: Any) -> str:
    """`avx512_vnni yes, amx no`: each of the CPU flags `names`, as a header says them."""
    return ", ".join(f"{k} {'yes' if flags.get(k) else 'no'}" for k in names)


def versions_said(versions: dict[str, Any] | None) -> str:
    """`torch 2.13.0, onnxruntime 1.24`: the versions, as a header says them."""
    return ", ".join(f"{k} {v}" for k, v in (versions or {}).items())


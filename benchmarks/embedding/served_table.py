"""The table of benchmarks/embedding/served.py: one row per server and concurrency from
every round's figures (each figure the median over the rounds, errors summed, resident
memory the largest seen, cold start the median of the starts); the ratios of compress's
servers to infinity's (each variant and the fastest) at every level; text and Markdown.

Pure functions over plain dicts (no server, no client), unit-tested in
tests/benchmarks/test_embedding.py.
"""

from __future__ import annotations

from typing import Any

from benchmarks.harness import servers
from benchmarks.harness.servers import median, shown
from benchmarks.harness.spread import aligned, ratio

FIGURES = ("embeddings_per_s", "latency_ms_p50", "latency_ms_p99")
COLUMNS = (("server", "name"), ("conc", "concurrency"), ("emb/s", "embeddings_per_s"),
           ("p50 ms", "latency_ms_p50"), ("p99 ms", "latency_ms_p99"), ("errors", "errors"),
           ("rounds", "rounds"), ("RSS MB", "rss_mb"), ("cold start s", "cold_start_s"))


def table_rows(items: list[dict[str, Any]], levels: list[int]) -> list[dict[str, Any]]:
    """One row per item and level. An item is {"key", "name", "kind", "rounds": [{"runs":
    [a level's figures], "cold_start_s", "rss_peak_bytes", "error"?}]}."""
    rows = []
    for item in items:
        rounds = item.get("rounds") or []
        rss = max((r.get("rss_peak_bytes") or 0 for r in rounds), default=0)
        cold = median([r.get("cold_start_s") for r in rounds])
        for level in levels:
            runs = [run for r in rounds for run in r.get("runs") or []
                    if run["concurrency"] == level]
            rows.append({"key": item["key"], "name": item["name"], "kind": item["kind"],
                         "concurrency": level, "rounds": len(runs),
                         "errors": sum(run["errors"] for run in runs) if runs else None,
                         "rss_mb": round(rss / 2**20) if rss else None, "cold_start_s": cold,
                         **{k: median([run.get(k) for run in runs]) for k in FIGURES}})
    return rows


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return ratio(top, bottom, 2)


def ratios(rows: list[dict[str, Any]], levels: list[int]) -> list[str]:
    """At each level: each compress server's embeddings/s over each infinity variant's and
    over the fastest infinity variant's there, and its p50 latency over that one's."""
    lines = []
    for level in levels:
        here = [r for r in rows if r["concurrency"] == level]
        peers = [r for r in here if r["kind"] == "infinity" and r.get("embeddings_per_s")]
        fastest = max(peers, key=lambda r: r["embeddings_per_s"], default=None)
        if fastest is not None:
            lines.append(f"c{level}: the fastest infinity is {fastest['name']} "
                         f"({fastest['embeddings_per_s']} emb/s)")
        for ours in (r for r in here if r["kind"] == "compress"):
            parts = [f"/ {peer['name']} " + shown(_ratio(ours.get("embeddings_per_s"),
                                                         peer["embeddings_per_s"]))
                     for peer in peers]
            if fastest is not None:
                parts.append("p50 latency / the fastest's " + shown(_ratio(
                    ours.get("latency_ms_p50"), fastest.get("latency_ms_p50"))))
            if parts:
                lines.append(f"c{level}: {ours['name']} emb/s " + ", ".join(parts))
    return lines


def render_text(rows: list[dict[str, Any]], lines: list[str]) -> str:
    """The table as aligned text, then the ratio and failure lines."""
    out = aligned([[t for t, _ in COLUMNS], *servers.cells(rows, COLUMNS)], 1)
    return "\n".join(out + [""] + lines) + "\n"


def render_markdown(rows: list[dict[str, Any]], lines: list[str], header: dict[str, Any]
                    ) -> str:
    """The table as Markdown under the header (date, CPU, command, facts), then the
    ratios and the notes."""
    return servers.markdown(rows, COLUMNS, 1, lines, header)

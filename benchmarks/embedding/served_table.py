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
from benchmarks.harness.spread import aligned

FIGURES = ("embeddings_per_s", "latency_ms_p50", "latency_ms_p99")
COLUMNS = (("server", "name"), ("batch", "batch"), ("threads", "threads"),
           ("conc", "concurrency"), ("emb/s", "embeddings_per_s"),
           ("p50 ms", "latency_ms_p50"), ("p99 ms", "latency_ms_p99"), ("errors", "errors"),
           ("rounds", "rounds"), ("RSS MB", "rss_mb"), ("cold start s", "cold_start_s"))


def table_rows(items: list[dict[str, Any]], levels: list[int]) -> list[dict[str, Any]]:
    """One row per item and level. An item is {"key", "name", "kind", "rounds": [{"runs":
    [a level's figures], "cold_start_s", "rss_peak_bytes", "error"?}]}."""
    return servers.level_rows(items, levels, FIGURES, copied=("kind", "batch", "threads"))


def ratios(rows: list[dict[str, Any]], levels: list[int]) -> list[str]:
    """At each level: each compress server's embeddings/s over each infinity variant's and
    over the fastest infinity variant's there, and its p50 latency over that one's."""
    return servers.rate_ratios(rows, levels, "embeddings_per_s", "emb/s")


def render_text(rows: list[dict[str, Any]], lines: list[str]) -> str:
    """The table as aligned text, then the ratio and failure lines."""
    out = aligned([[t for t, _ in COLUMNS], *servers.cells(rows, COLUMNS)], 3)
    return "\n".join(out + [""] + lines) + "\n"


def render_markdown(rows: list[dict[str, Any]], lines: list[str], header: dict[str, Any]
                    ) -> str:
    """The table as Markdown under the header (date, CPU, command, facts), then the
    ratios and the notes."""
    return servers.markdown(rows, COLUMNS, 3, lines, header)

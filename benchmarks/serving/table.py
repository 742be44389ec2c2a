"""The engines table (benchmarks/serving/engines.py): each engine's rounds reduced to medians
and spreads, its throughput at the load's concurrency against TorchServe's, and its latency
a lone request (concurrency 1) against LitServe's: the engine's own cost a request beside
the engine with the same handler process and no proxy hop.

Pure functions over the rounds' figures (no server, no torch), tested in
tests/benchmarks/test_serving_engines.py."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.provenance import header_lines
from benchmarks.harness.spread import cell, markdown_rows, ratio, spread

REFERENCE, NO_HOP = "torchserve", "litserve"  # throughput against; lone latency against
COLUMNS = (("req/s", "rps_median", 1), ("req/s min-max", "rps_range", 0),
           ("p50 ms", "p50_ms_median", 1), ("p99 ms", "p99_ms_median", 1),
           ("x TorchServe req/s", "rps_vs_reference", 2),
           ("c1 p50 ms", "lone_p50_ms_median", 2),
           ("c1 cost over LitServe ms", "lone_cost_ms", 2),
           ("server CPU ms/req", "cpu_ms_median", 2),
           ("load generator CPU ms/req", "client_cpu_ms_median", 2),
           ("server CPU ms/req by process", "cpu_where", 0),
           ("start s", "start_s_median", 1), ("errors", "errors", 0))


def engine_row(name: str, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine's figures over its rounds (each round: `rps`, `p50_ms`, `p99_ms`,
    `lone_p50_ms`, `start_s`, `cpu_ms`, `client_cpu_ms`, `cpu_where`, `errors`); `error`
    when no round finished."""
    done = [r for r in rounds if not r.get("error")]
    row: dict[str, Any] = {"engine": name, "rounds": done,
                           "errors": sum(int(r.get("errors") or 0) for r in done)}
    failed = [r["error"] for r in rounds if r.get("error")]
    if failed:
        row["error"] = failed[0]
    for key in ("rps", "p50_ms", "p99_ms", "lone_p50_ms", "start_s", "cpu_ms",
                "client_cpu_ms"):
        row |= spread([r[key] for r in done if r.get(key) is not None], key)
    if done:
        row["rps_range"] = f"{row['rps_min']:.0f}-{row['rps_max']:.0f}"
        row["cpu_where"] = done[0].get("cpu_where") or "-"
    return row


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` with their throughput over TorchServe's (median over median) and their lone
    request's latency minus LitServe's (ms; positive: the engine costs that much more)."""
    by_name = {row["engine"]: row for row in rows}
    reference = by_name.get(REFERENCE, {}).get("rps_median")
    no_hop = by_name.get(NO_HOP, {}).get("lone_p50_ms_median")
    for row in rows:
        row["rps_vs_reference"] = ratio(row.get("rps_median"), reference, 3)
        lone = row.get("lone_p50_ms_median")
        row["lone_cost_ms"] = (round(lone - no_hop, 3)
                               if lone is not None and no_hop is not None else None)
    return rows


def markdown(rows: list[dict[str, Any]], header: dict[str, Any], setup: list[str]) -> str:
    """The results file: title, provenance header, the load's description, the table."""
    head = ["engine", *(c[0] for c in COLUMNS)]
    body = [[row["engine"], *(row.get(key) if isinstance(row.get(key), str)
                              else cell(row.get(key), decimals)
                              for _, key, decimals in COLUMNS)] for row in rows]
    lines = ["# Serving engines: one archive on TorchServe, LitServe and Ray Serve", "",
             *header_lines(header), "", *setup, "", *markdown_rows(head, body)]
    lines += [f"\n{row['engine']}: failed: {row['error']}" for row in rows if row.get("error")]
    return "\n".join(lines) + "\n"

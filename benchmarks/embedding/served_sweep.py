"""The sweep of benchmarks/embedding/served.py: before the measured rounds, every server
(each compress engine, each infinity variant) is started at every setting of a small grid,
batch sizes x intra-op threads, and loaded at one concurrency (the highest measured) with a
short load; each server is then measured at the setting where it returned the most
embeddings a second with no failed call. The same grid and load for every server, ours
included.

The grid, the choice and the sweep's table are pure functions over plain dicts, unit-tested
in tests/benchmarks/test_embedding.py; `run_sweep` takes the function that starts, loads
and stops one server at one setting.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from benchmarks.harness.servers import cells
from benchmarks.harness.spread import aligned

COLUMNS = (("server", "name"), ("batch", "batch"), ("threads", "threads"),
           ("emb/s", "embeddings_per_s"), ("p50 ms", "latency_ms_p50"), ("errors", "errors"),
           ("chosen", "chosen"))


def default_threads(cores: int | None = None) -> list[int]:
    """Thread counts to try on a machine of `cores` (default: this one's): the powers of two
    below it and the count itself (1,2 on 2 cores; 1,2,4,8,12 on 12)."""
    cores = max(1, cores or os.cpu_count() or 1)
    return sorted({2 ** i for i in range(cores.bit_length()) if 2 ** i < cores} | {cores})


def grid(batches: list[int], threads: list[int]) -> list[dict[str, int]]:
    """Every (batch, threads) setting, batch-major."""
    return [{"batch": b, "threads": t} for b in batches for t in threads]


def usable(trial: dict[str, Any]) -> bool:
    """A setting that counts: the server started, every call answered, a rate measured."""
    return not trial.get("error") and not trial.get("errors") and bool(
        trial.get("embeddings_per_s"))


def choose(trials: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The usable trial with the most embeddings a second (a tie: fewer threads, then the
    smaller batch); None when no trial is usable."""
    kept = [t for t in trials if usable(t)]
    if not kept:
        return None
    return max(kept, key=lambda t: (t["embeddings_per_s"], -t["threads"], -t["batch"]))


def apply_choice(item: dict[str, Any], trials: list[dict[str, Any]]) -> None:
    """Record the sweep on `item` (its "sweep": the trials and the chosen setting) and set
    its "batch" and "threads"; with no usable trial, the item's "error" says why."""
    best = choose(trials)
    item["sweep"] = {"trials": trials, "chosen": None if best is None else {
        "batch": best["batch"], "threads": best["threads"],
        "embeddings_per_s": best["embeddings_per_s"]}}
    if best is None:
        why = next((t.get("error") or f"{t['errors']} failed calls" for t in trials
                    if t.get("error") or t.get("errors")), "no rate measured")
        item["error"] = f"sweep: no setting answered every call ({why})"
        return
    item["batch"], item["threads"] = best["batch"], best["threads"]


def run_sweep(items: list[dict[str, Any]], settings: list[dict[str, int]],
              trial: Callable[[dict[str, Any], dict[str, int]], dict[str, Any]],
              echo: Callable[[str], None]) -> None:
    """Try every item (those not already failed) at every setting, then choose for each."""
    for item in items:
        if item.get("error"):
            continue
        trials = []
        for setting in settings:
            figures = {**setting, **trial(item, setting)}
            trials.append(figures)
            echo(f"serve_peers_embed: sweep: {item['name']} b{setting['batch']} "
                 f"t{setting['threads']}: " + (f"failed: {figures['error']}"
                                               if figures.get("error") else
                                               f"{figures.get('embeddings_per_s')} emb/s"
                                               + (f" ({figures['errors']} errors)"
                                                  if figures.get("errors") else "")))
        apply_choice(item, trials)
        chosen = item["sweep"]["chosen"]
        echo(f"serve_peers_embed: sweep: {item['name']}: " + (
            f"chose batch {chosen['batch']}, {chosen['threads']} thread(s)" if chosen else
            item["error"]))


def sweep_rows(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per server and setting tried, the chosen one marked."""
    rows = []
    for item in items:
        sweep = item.get("sweep") or {}
        chosen = sweep.get("chosen") or {}
        for t in sweep.get("trials") or []:
            rows.append({"name": item["name"], "batch": t["batch"], "threads": t["threads"],
                         "embeddings_per_s": t.get("embeddings_per_s"),
                         "latency_ms_p50": t.get("latency_ms_p50"),
                         "errors": "failed" if t.get("error") else t.get("errors"),
                         "chosen": "yes" if (t["batch"], t["threads"]) == (
                             chosen.get("batch"), chosen.get("threads")) else ""})
    return rows


def sweep_text(rows: list[dict[str, Any]]) -> str:
    """The sweep as aligned text ('' when there was none)."""
    if not rows:
        return ""
    table = aligned([[t for t, _ in COLUMNS], *cells(rows, COLUMNS)], 3)
    return "\n".join(["Sweep:", *table]) + "\n"


def sweep_markdown(rows: list[dict[str, Any]], how: str) -> str:
    """The sweep as a Markdown section under the results ('' when there was none): `how`
    says the load and the rule, then every setting tried."""
    if not rows:
        return ""
    out = ["", "## Sweep: each server's batch size and threads", "", how, "",
           "| " + " | ".join(t for t, _ in COLUMNS) + " |",
           "|" + "|".join("---" if t in ("server", "chosen") else "---:"
                          for t, _ in COLUMNS) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in cells(rows, COLUMNS)]
    return "\n".join(out) + "\n"

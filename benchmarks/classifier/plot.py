"""The front of benchmarks/classifier/peers.py as a picture: accuracy against batch 8 x 128
latency for every row of the table, all timed in the same invocation. compress's artifacts
(and the search front trials) are circles with their Pareto front; the peers (Optimum,
OpenVINO) are diamonds; a point is the median round, its bar spans the fastest to the
slowest round; the line is the tolerance under the fine-tuned model's accuracy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness.flops import FLOPS_BATCH
from compress.report.plot import pareto_front, pyplot, save_figure


def points_of(rows: list[dict[str, Any]], peer: bool) -> list[tuple[float, float, str]]:
    """(b8 x 128 ms, accuracy %, artifact) of the measured rows that are (not) peers."""
    key = f"latency_ms_b{FLOPS_BATCH}"
    return [(r[key], r["accuracy_pct"], r["artifact"]) for r in rows
            if bool(r.get("peer")) == peer and r.get(key) and r.get("accuracy_pct") is not None]


def spans_of(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """(fastest, slowest round) of b8 x 128 per artifact whose rounds differ."""
    key = f"latency_ms_b{FLOPS_BATCH}"
    return {r["artifact"]: (r[f"{key}_min"], r[f"{key}_max"]) for r in rows
            if r.get(f"{key}_min") and r.get(f"{key}_max") and r[f"{key}_max"] > r[f"{key}_min"]}


def plot_front(rows: list[dict[str, Any]], path: Path, reference: str | None,
               max_drop: float | None) -> Path | None:
    """Write the plot; None without matplotlib or measured rows. `reference` names the row
    the tolerance line (`max_drop` points) is drawn under."""
    ours, peers = points_of(rows, peer=False), points_of(rows, peer=True)
    plt = pyplot() if ours or peers else None
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(9, 6), dpi=120)
    spans = spans_of(rows)
    for points, color in ((ours, "tab:blue"), (peers, "tab:orange")):
        for x, y, name in points:
            if name in spans:
                low, high = spans[name]
                ax.errorbar([x], [y], xerr=[[max(x - low, 0)], [max(high - x, 0)]], fmt="none",
                            ecolor=color, elinewidth=1, capsize=2, alpha=0.6, zorder=2)
    front = pareto_front(ours)
    on_front = {p[2] for p in front}
    for i, (x, y, name) in enumerate(sorted(ours)):
        ax.scatter(x, y, s=45, color="tab:blue", zorder=3, linewidths=1.5,
                   edgecolors="tab:green" if name in on_front else "none")
        ax.annotate(name, (x, y), textcoords="offset points", fontsize=6,
                    xytext=(6, 5 if i % 2 == 0 else -10))
    if front:
        ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:green", ls="--",
                label="compress: Pareto front (green rings)")
    for x, y, name in peers:
        ax.scatter(x, y, s=70, marker="D", color="tab:orange", zorder=4)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, -11), fontsize=7,
                    color="tab:orange")
    ax.scatter([], [], marker="D", color="tab:orange", label="peers (Optimum, OpenVINO)")
    base = next((r for r in rows if r["artifact"] == reference), None)
    if base and base.get("accuracy_pct") is not None and max_drop is not None:
        ax.axhline(base["accuracy_pct"] - max_drop, color="tab:gray", ls=":",
                   label=f"{max_drop:g} pt below {reference}")
    ax.set_xscale("log")
    ax.set_xlabel(f"batch {FLOPS_BATCH} x 128 latency (ms, log scale; median round, bars: "
                  "fastest to slowest round)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title("accuracy against latency, every file timed in one invocation", fontsize=10)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(loc="lower right", fontsize=8)
    return save_figure(fig, path)

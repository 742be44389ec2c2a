"""`report.png`: accuracy against latency, one labelled point per artifact, Pareto front."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pareto_front(points: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """The points no other point beats on both axes (lower latency, higher accuracy),
    ordered by latency."""
    front: list[tuple[float, float, str]] = []
    for point in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or point[1] > front[-1][1]:
            front.append(point)
    return front


def plot_points(report: dict[str, Any]) -> tuple[int | None, list[tuple[float, float, str]]]:
    """(batch size, [(latency ms, accuracy %, label)]) of the rows that have both figures;
    the largest batch size every measured row shares."""
    rows = [r for r in report["rows"] if r.get("accuracy_pct") is not None
            and r.get("status") != "failed"]
    for batch in sorted(report["batch_sizes"], reverse=True):
        points = [(r[f"p50_ms_b{batch}"], r["accuracy_pct"], r["name"]) for r in rows
                  if r.get(f"p50_ms_b{batch}")]
        if points:
            return batch, points
    return None, []


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display), or None when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, path: Path) -> Path:
    """Write `fig` to `path` through a temporary file and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path


def plot_report(report: dict[str, Any], path: Path) -> Path | None:
    """Write the plot (matplotlib, no display); None when there is nothing to plot or
    matplotlib is not installed."""
    batch, points = plot_points(report)
    plt = pyplot() if points else None
    if plt is None:
        return None
    front = pareto_front(points)
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    on_front = {p[2] for p in front}
    for latency, accuracy, label in points:
        color = "tab:green" if label in on_front else "tab:blue"
        ax.scatter(latency, accuracy, s=45, color=color, zorder=3)
        ax.annotate(label, (latency, accuracy), textcoords="offset points", xytext=(6, 4),
                    fontsize=8)
    ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:green", lw=1.2,
            ls="--", zorder=2, label="Pareto front (faster and more accurate)")
    ax.set_xscale("log")
    from matplotlib.ticker import FormatStrFormatter

    ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xlabel(f"median latency at batch {batch} (ms, log scale)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"{report['run']}: accuracy against latency "
                 f"({report['header'].get('cpu')}, {report['header'].get('threads')} threads)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return save_figure(fig, path)

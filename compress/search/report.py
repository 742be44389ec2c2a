"""What a search leaves in its stage folder: `search.json` (every trial), `section.md`
(the table the run's report.md includes) and `search.png` (all trials, the Pareto front,
the tolerance and the winner)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from compress.report.plot import pareto_front, pyplot, save_figure
from compress.runfolder.files import atomic_write_json, atomic_write_text
from compress.search.choice import points

DROPPED = ("preds", "key")  # not worth keeping in search.json


def write_search_files(folder: Path, run_dir: Path, cfg, search, skipped: dict[str, str],
                       outcome: dict[str, Any]) -> dict[str, Any]:
    """Write search.json, section.md and search.png; the stage's summary figures."""
    trials = [{k: v for k, v in t.items() if k not in DROPPED}
              for t in search.trials + search.not_run]
    reference = {k: v for k, v in search.reference.items() if k not in DROPPED}
    winner = outcome["winner"]
    record = {"objective": cfg.objective, "metric": search.metric,
              "max_accuracy_drop": cfg.max_accuracy_drop, "reference": reference,
              "skipped": skipped, "winner": winner["id"] if winner else None,
              "verdict": outcome["verdict"], "trials_run": search.ran,
              "trials_cached": sum(bool(t.get("cached")) for t in search.trials),
              "search_s": round(time.perf_counter() - search.began, 1),
              "sensitivity": "sensitivity.json" if (folder / "sensitivity.json").is_file()
              else None, "shapes": list(search.shapes), "trials": trials}
    atomic_write_json(folder / "search.json", record)
    plot = plot_search(record, folder / "search.png")
    atomic_write_text(folder / "section.md", section(record, folder, run_dir, plot))
    summary = {"search_trials": len(search.trials), "search_trials_run": search.ran,
               "search_reference_accuracy": reference.get("accuracy"),
               "search_max_accuracy_drop": cfg.max_accuracy_drop,
               "search_objective": cfg.objective}
    if winner:
        summary.update(search_winner=winner["candidate"], search_winner_trial=winner["id"],
                       search_fallback_layers=winner["float_layers"],
                       search_accuracy_drop=winner["drop"])
        if winner.get("shape"):
            summary["search_winner_shape"] = winner["shape"]
    return summary


def section(record: dict[str, Any], folder: Path, run_dir: Path, plot: Path | None) -> str:
    """The markdown the report includes: the verdict, every trial and why it lost."""
    metric = record["metric"]
    ref = record["reference"]
    lines = [f"## Search: {record['objective']} within {record['max_accuracy_drop']:g} point"
             f" of the entering model ({100 * ref.get('accuracy', 0):.2f}%)", "",
             f"{record['verdict']}.", "",
             "| trial | float layers | accuracy % | Δ pt | agreement | b1 ms | b8 ms | "
             "b8 real ms | MB | re-timed ms | outcome |", "|" + "---|" * 11]
    ok = [t for t in record["trials"] if t.get("status") == "ok"]
    order = sorted(ok, key=lambda t: ("final_ms" not in t, t.get("final_ms") or 0,
                                      t.get(metric, float("inf"))))
    for t in order + [
            t for t in record["trials"] if t.get("status") != "ok"]:
        name = f"**{t['id']}**" if t.get("won") else t["id"]
        if t.get("status") != "ok":
            lines.append(f"| {name} | {len(t.get('float_layers') or [])} | | | | | | | | | "
                         f"{t.get('lost') or t.get('error')} |")
            continue
        cells = [name, str(len(t["float_layers"])), f"{100 * t['accuracy']:.2f}",
                 points(t["drop"]), f"{t.get('agreement', 0):.4f}",
                 *(_ms(t.get(k)) for k in ("latency_ms_b1", "latency_ms_b8",
                                           "latency_ms_b8_real")),
                 f"{t['bytes'] / 1e6:.1f}", _ms(t.get("final_ms")),
                 "winner" if t.get("won") else t.get("lost", "")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Reference (the entering model, PyTorch eager): b1 "
              f"{_ms(ref.get('latency_ms_b1'))} ms, b8 {_ms(ref.get('latency_ms_b8'))} ms, "
              f"b8 real {_ms(ref.get('latency_ms_b8_real'))} ms."]
    for shape in record.get("shapes") or []:
        if shape.get("status") == "not run":
            lines.append(f"Shape {shape['label']}: not trained ({shape['lost']}).")
            continue
        lines.append(f"Shape {shape['label']}: {shape['layers']} of {shape['teacher_layers']} "
                     f"layers, {shape['params'] / 1e6:.1f}M parameters, "
                     + ("cached" if shape.get("cached") else f"trained in {shape['train_s']:g} s")
                     + ".")
    for name, why in record["skipped"].items():
        lines.append(f"Skipped {name}: it {why}.")
    if record.get("sensitivity"):
        lines.append(f"Layer ranking: {(folder / record['sensitivity']).relative_to(run_dir)}.")
    if plot is not None:
        lines += ["", f"![search trials]({plot.relative_to(run_dir)})"]
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def plot_search(record: dict[str, Any], path: Path) -> Path | None:
    """Accuracy against the objective for every trial: the Pareto front, the tolerance
    line and the winner marked (None without matplotlib or trials)."""
    metric = record["metric"]
    points = [(t.get("final_ms") or t[metric], 100 * t["accuracy"], t["id"])
              for t in record["trials"] if t.get("status") == "ok" and t.get(metric)]
    plt = pyplot() if points else None
    if plt is None:
        return None
    scale = 1e6 if metric == "bytes" else 1.0
    front = pareto_front([(x / scale, y, n) for x, y, n in points])
    on_front = {p[2] for p in front}
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for i, (x, y, name) in enumerate(sorted(points)):
        won = name == record["winner"]
        ax.scatter(x / scale, y, s=170 if won else 45, marker="*" if won else "o",
                   color="tab:red" if won else "tab:blue", zorder=3,
                   edgecolors="tab:green" if name in on_front else "none", linewidths=1.5)
        ax.annotate(name.rsplit("-", 1)[0], (x / scale, y), textcoords="offset points",
                    xytext=(6, 5 if i % 2 == 0 else -11), fontsize=7)
    ax.plot([p[0] for p in front], [p[1] for p in front], color="tab:green", ls="--",
            label="Pareto front (green rings)")
    reference = record["reference"]
    if reference.get(metric) and reference.get("accuracy") is not None:
        ax.scatter(reference[metric] / scale, 100 * reference["accuracy"], marker="x",
                   color="tab:gray", s=50, zorder=3, label="entering model, PyTorch eager")
    bound = 100 * reference.get("accuracy", 0) - record["max_accuracy_drop"]
    ax.axhline(bound, color="tab:gray", ls=":",
               label=f"tolerance: {record['max_accuracy_drop']:g} pt below the entering model")
    ax.set_xlabel("file size (MB)" if metric == "bytes" else f"{metric} (ms)")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"search: every trial, winner starred ({record['objective']}; re-timed "
                 f"finalists at their re-timed medians)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return save_figure(fig, path)

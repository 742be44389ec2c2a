"""What a search leaves in its stage folder: `search.json` (every trial), `section.md`
(the table the run's report.md includes) and `search.png` (all trials, the Pareto front,
the tolerance and the winner)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from compress.recipe.kinds.search import BUDGETS
from compress.report.plot import pareto_front, pyplot, save_figure
from compress.runfolder.files import atomic_write_json, atomic_write_text
from compress.search.quality import Quality

DROPPED = ("preds", "key")  # not worth keeping in search.json


def write_search_files(folder: Path, run_dir: Path, cfg, search, skipped: dict[str, str],
                       outcome: dict[str, Any]) -> dict[str, Any]:
    """Write search.json, section.md and search.png; the stage's summary figures."""
    trials = [{k: v for k, v in t.items() if k not in DROPPED}
              for t in search.trials + search.not_run]
    reference = {k: v for k, v in search.reference.items() if k not in DROPPED}
    winner = outcome["winner"]
    quality: Quality = search.quality
    record = {"objective": cfg.objective, "metric": search.metric,
              "budget": quality.budget, **{k: getattr(cfg, k) for k in BUDGETS
                                           if getattr(cfg, k) is not None},
              "reference": reference,
              "skipped": skipped, "winner": winner["id"] if winner else None,
              "verdict": outcome["verdict"], "trials_run": search.ran,
              "trials_cached": sum(bool(t.get("cached")) for t in search.trials),
              "search_s": round(time.perf_counter() - search.began, 1),
              "sensitivity": "sensitivity.json" if (folder / "sensitivity.json").is_file()
              else None, "shapes": list(search.shapes), "trials": trials}
    atomic_write_json(folder / "search.json", record)
    plot = plot_search(record, quality, folder / "search.png")
    atomic_write_text(folder / "section.md", section(record, quality, folder, run_dir, plot))
    summary = {"search_trials": len(search.trials), "search_trials_run": search.ran,
               "search_objective": cfg.objective, **quality.summary(reference, winner)}
    if winner:
        summary.update(search_winner=winner["candidate"], search_winner_trial=winner["id"],
                       search_fallback_layers=winner["float_layers"])
        if winner.get("shape"):
            summary["search_winner_shape"] = winner["shape"]
    return summary


def section(record: dict[str, Any], quality: Quality, folder: Path, run_dir: Path,
            plot: Path | None) -> str:
    """The markdown the report includes: the verdict, every trial and why it lost."""
    metric = record["metric"]
    ref = record["reference"]
    columns = quality.columns()
    timed = [(k, label) for k, label in (
        ("latency_ms_b1", "b1 ms"), ("latency_ms_b8", "b8 ms"),
        ("latency_ms_b8_real", "b8 real ms"), ("latency_ms_b32_real", "b32 real ms"))
        if k in ref or any(k in t for t in record["trials"])]
    headers = ["trial", "float layers", *(h for h, _ in columns), *(h for _, h in timed),
               "MB", "re-timed ms", "outcome"]
    lines = [f"## Search: {record['objective']} {quality.headline(ref)}", "",
             f"{record['verdict']}.", "",
             "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    ok = [t for t in record["trials"] if t.get("status") == "ok"]
    order = sorted(ok, key=lambda t: ("final_ms" not in t, t.get("final_ms") or 0,
                                      t.get(metric, float("inf"))))
    for t in order + [
            t for t in record["trials"] if t.get("status") != "ok"]:
        name = f"**{t['id']}**" if t.get("won") else t["id"]
        if t.get("status") != "ok":
            blank = " |" * (len(headers) - 2) + " "
            lines.append(f"| {name} | {len(t.get('float_layers') or [])}{blank}"
                         f"{t.get('lost') or t.get('error')} |")
            continue
        cells = [name, str(len(t["float_layers"])), *(quality.cell(t, k) for _, k in columns),
                 *(_ms(t.get(k)) for k, _ in timed),
                 f"{t['bytes'] / 1e6:.1f}", _ms(t.get("final_ms")),
                 "winner" if t.get("won") else t.get("lost", "")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Reference (the entering model, PyTorch eager): " + ", ".join(
        f"{label.removesuffix(' ms')} {_ms(ref.get(k))} ms" for k, label in timed) + "."]
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


def plot_search(record: dict[str, Any], quality: Quality, path: Path) -> Path | None:
    """Quality against the objective for every trial: the Pareto front, the budget's line
    and the winner marked (None without matplotlib or trials)."""
    metric = record["metric"]
    points = [(t.get("final_ms") or t[metric], quality.scale * t[quality.key], t["id"])
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
    if reference.get(metric) and reference.get(quality.key) is not None:
        ax.scatter(reference[metric] / scale, quality.scale * reference[quality.key],
                   marker="x", color="tab:gray", s=50, zorder=3,
                   label="entering model, PyTorch eager")
    floor = quality.floor(reference)
    if floor is not None:
        ax.axhline(quality.scale * floor, color="tab:gray", ls=":",
                   label=f"budget: {quality.budget}")
    ax.set_xlabel("file size (MB)" if metric == "bytes" else f"{metric} (ms)")
    ax.set_ylabel(quality.label)
    ax.set_title(f"search: every trial, winner starred ({record['objective']}; re-timed "
                 f"finalists at their re-timed medians)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return save_figure(fig, path)

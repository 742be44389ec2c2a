"""How the search picks its winner: the finalists timed again in alternating rounds in
one process (the machine's noise moves single timings 20-30%), then the best objective
among the trials within the tolerance; re-timed finalists within TIE_SPREAD of the fastest
count as equally fast (the same shape in the same runtime) and the best of them by the
family's quality (accuracy, fidelity) wins. Every other trial is told why it lost."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compress.search.quality import Quality

FINALIST_SPREAD = 1.3  # trials within this factor of the best objective are timed again
MAX_FINALISTS = 4
TIE_SPREAD = 1.03  # re-timed finalists this close to the fastest are as fast: quality decides


def describe(record: dict[str, Any], metric: str, quality: Quality) -> str:
    """One progress line for a finished trial."""
    source = "cached" if record.get("cached") else f"{record.get('trial_s', 0):.0f} s"
    if record["status"] != "ok":
        return f"{record['id']}: failed ({source}): {record.get('error')}"
    latency = ", ".join(f"{label} {record[key]:.1f} ms" for key, label in (
        ("latency_ms_b1", "b1"), ("latency_ms_b8", "b8"), ("latency_ms_b8_real", "b8 real"),
        ("latency_ms_b32_real", "b32 real")) if key in record)
    return (f"{record['id']} ({source}): {quality.line(record)}, {latency}, "
            f"{record['bytes'] / 1e6:.1f} MB; objective {_value(record, metric)}")


def _value(record: dict[str, Any], metric: str) -> str:
    value = record.get(metric)
    if value is None:
        return "?"
    return f"{value / 1e6:.1f} MB" if metric == "bytes" else f"{value:.2f} ms"


def retime_finalists(trials: list[dict[str, Any]], cfg, metric: str, measurer,
                     run_dir: Path, log: Callable[[str], None]) -> None:
    """Time the trials within the tolerance whose objective is within FINALIST_SPREAD of
    the best again, `cfg.final_rounds` rounds in alternating order, in this process; each
    gets `final_ms` (median of its rounds) and `final_rounds_ms`."""
    eligible = sorted((t for t in trials if t["status"] == "ok" and t["within"]
                       and metric in t), key=lambda t: t[metric])
    if metric == "bytes" or cfg.final_rounds == 0 or len(eligible) < 2:
        return
    best = eligible[0][metric]
    chosen = [t for t in eligible if t[metric] <= FINALIST_SPREAD * best][:MAX_FINALISTS]
    if len(chosen) < 2:
        return
    from compress.models.folders import load_export

    log(f"timing the {len(chosen)} finalists again, {cfg.final_rounds} alternating rounds: "
        + ", ".join(t["id"] for t in chosen))
    models = [load_export(run_dir / t["folder"] / t["export_dir"], measurer.threads)
              for t in chosen]
    rounds: list[list[float]] = [[] for _ in chosen]
    began = time.perf_counter()
    for r in range(cfg.final_rounds):
        order = range(len(chosen)) if r % 2 == 0 else reversed(range(len(chosen)))
        for i in order:
            rounds[i].append(measurer.objective_ms(models[i], metric))
    for trial, samples in zip(chosen, rounds, strict=True):
        trial["final_rounds_ms"] = [round(s, 3) for s in samples]
        trial["final_ms"] = round(statistics.median(samples), 3)
    log(f"finalists in {time.perf_counter() - began:.0f} s: " + ", ".join(
        f"{t['id']} {t['final_ms']:.2f} ms" for t in chosen))


def decide(trials: list[dict[str, Any]], metric: str, quality: Quality) -> dict[str, Any]:
    """{"winner": the best trial within the tolerance or None, "verdict": one line};
    every trial gets `lost` (why it is not the winner) or `won`."""
    ok = [t for t in trials if t["status"] == "ok" and metric in t]
    eligible = [t for t in ok if t["within"]]
    for trial in trials:
        if trial["status"] != "ok":
            trial["lost"] = f"failed: {trial.get('error')}"
        elif not trial["within"]:
            trial["lost"] = quality.outside(trial)
            if trial.get("stopped"):
                trial["lost"] += f" ({trial['stopped']})"
    if not eligible:
        closest = min(ok, key=lambda t: t["shortfall"], default=None)
        near = f"; the closest is {closest['id']} at {quality.gap(closest)}" if closest else ""
        return {"winner": None,
                "verdict": f"no trial is within {quality.budget} of {quality.against}{near}; "
                           f"{quality.loosen} or add candidates (every trial is in "
                           f"search.json)"}
    finals = [t for t in eligible if "final_ms" in t]
    if finals:
        fastest = min(t["final_ms"] for t in finals)
        tied = [t for t in finals if t["final_ms"] <= TIE_SPREAD * fastest]
        winner = max(tied, key=lambda t: (t[quality.key], -t["final_ms"]))
    else:
        winner = min(eligible, key=lambda t: t[metric])
    winner["won"] = True
    for trial in eligible:
        if trial is winner:
            continue
        if "final_ms" in trial and trial["final_ms"] <= TIE_SPREAD * winner["final_ms"]:
            trial["lost"] = (f"as fast when re-timed ({_fmt(trial['final_ms'], metric)} "
                             f"against {_fmt(winner['final_ms'], metric)}, within "
                             f"{100 * (TIE_SPREAD - 1):.0f}%) and {quality.worse} "
                             f"({quality.value(trial)} against {quality.value(winner)})")
        elif "final_ms" in trial:
            trial["lost"] = (f"slower when re-timed: {_fmt(trial['final_ms'], metric)} against "
                             f"the winner's {_fmt(winner['final_ms'], metric)}")
        else:
            trial["lost"] = (f"slower: {_fmt(trial[metric], metric)} against the winner's "
                             f"{_fmt(winner[metric], metric)}")
    key = "final_ms" if finals else metric
    score = winner[key]
    verdict = (f"winner {winner['id']}: {quality.line(winner)}, {_fmt(score, metric)}"
               + (" (re-timed against the other finalists)" if key == "final_ms" else ""))
    return {"winner": winner, "verdict": verdict}


def _fmt(value: float, metric: str) -> str:
    return f"{value / 1e6:.1f} MB" if metric == "bytes" else f"{value:.2f} ms"

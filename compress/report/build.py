"""Reports of run folders: one row per artifact, read from the manifest (no model is run).

`build_report` turns a run folder into a dict (what `report.json` holds); `render_table`,
`render_markdown` and `write_reports` present it; `compare` puts several runs in one table
with the best value of each column marked.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from compress.errors import UserError
from compress.report.render import LM_EVAL, render_markdown, render_table  # noqa: F401 (API)
from compress.report.runtimes import reference_index, runtime_label
from compress.runfolder.files import atomic_write_json, atomic_write_text, now
from compress.runfolder.records import Baseline, Manifest, StageRecord, require_manifest


def build_report(run_dir: str | Path, reference: str | None = None) -> dict[str, Any]:
    """The report of one run folder: header, rows (baseline, each stage), served figures.

    `reference` names the row deltas, ratios and speedups compare with (default: the first
    stage's model when its kind is a reference kind (fine-tuned), else the baseline)."""
    run_dir = Path(run_dir)
    manifest = require_manifest(run_dir)
    latency = manifest.latency_settings()
    batches = latency.get("batch_sizes") or []
    rows = []
    if manifest.baseline is not None:
        rows.append(_row("baseline", "baseline", manifest.baseline, "PyTorch eager"))
    for i, stage in enumerate(manifest.recipe_stages()):
        name = stage.get("name") or stage["kind"]
        entry = manifest.stages[i] if i < len(manifest.stages) else None
        if entry is None or entry.name != name:
            rows.append({"name": name, "kind": stage["kind"], "status": "not run",
                         "runtime": runtime_label(manifest, i, stage), "metrics": {}})
            continue
        rows.append(_row(name, stage["kind"], entry, runtime_label(manifest, i)))
    task = manifest.model.get("task", "classification")
    ref = _reference(rows, manifest, reference, task)
    fresh = _read_json(run_dir / "bench.json")
    generation = ((manifest.recipe.get("evaluation") or {}).get("generation") or {})
    decode_batches = generation.get("batch_sizes") or [1, 4]
    for row in rows:
        _derive(row, ref, batches)
        if task == "causal-lm":
            derive_causal_lm(row, ref, decode_batches)
        if task == "embedding":
            derive_embedding(row)
        if task == "reranking":  # its ranking figures, as measured
            row.update({key: row["metrics"][key] for key in RERANKER_QUALITY
                        if row["metrics"].get(key) is not None})
        figures = ((fresh or {}).get("artifacts") or {}).get(row["name"]) or {}
        for b in batches:
            if figures.get(f"latency_ms_b{b}"):
                row[f"fresh_p50_ms_b{b}"] = figures[f"latency_ms_b{b}"]
                row[f"fresh_p90_ms_b{b}"] = figures.get(f"latency_ms_b{b}_p90")
    return {"run": manifest.name, "run_dir": str(run_dir), "generated": now(), "task": task,
            "decode_batch_sizes": decode_batches if task == "causal-lm" else [],
            "updated": manifest.updated, "header": _header(manifest),
            "reference": ref["name"] if ref else None, "batch_sizes": batches,
            "seq_len": latency.get("seq_len"),
            "rows": rows, "served": _read_json(run_dir / "loadtest.json"),
            "sections": _sections(run_dir, manifest),
            "fresh": {k: fresh[k] for k in ("measured", "settings") if k in fresh}
            if fresh else None}


def _row(name: str, kind: str, entry: StageRecord | Baseline, runtime: str) -> dict[str, Any]:
    outputs = getattr(entry, "outputs", [])
    row = {"name": name, "kind": kind, "status": entry.status or "unknown",
           "runtime": runtime, "metrics": dict(entry.metrics),
           "artifact": outputs[0].path if outputs else None}
    if getattr(entry, "error", None):
        row["error"] = entry.error
    return row


def _reference(rows: list[dict], manifest: Manifest, wanted: str | None,
               task: str = "classification") -> dict | None:
    score = "perplexity" if task == "causal-lm" else "accuracy"
    measured = [r for r in rows if r["metrics"].get(score) is not None]
    if wanted:
        for row in rows:
            if row["name"] == wanted:
                return row
        names = ", ".join(r["name"] for r in rows)
        raise UserError(f"--reference {wanted}: no such row (rows: {names})")
    index = reference_index(manifest)
    if index is not None:
        name = manifest.stages[index].name
        for row in measured:
            if row["name"] == name:
                return row
    return next((r for r in rows if r["name"] == "baseline"), measured[0] if measured else None)


def _derive(row: dict[str, Any], ref: dict | None, batches: list[int]) -> None:
    """Columns computed from the manifest's metrics: deltas, ratios, throughput, speedup."""
    m, r = row["metrics"], (ref or {}).get("metrics", {})
    if m.get("accuracy") is not None:
        row["accuracy_pct"] = round(100 * m["accuracy"], 2)
        if r.get("accuracy") is not None:
            row["accuracy_delta_pt"] = round(100 * (m["accuracy"] - r["accuracy"]), 2)
    for key in ("macro_f1", "size_mb", "sparsity"):
        if m.get(key) is not None:
            row[key] = m[key]
    if m.get("params"):
        row["params_m"] = round(m["params"] / 1e6, 3)
    if m.get("size_mb") and r.get("size_mb"):
        row["size_ratio"] = round(m["size_mb"] / r["size_mb"], 3)
    for b in batches:
        median, p90 = m.get(f"latency_ms_b{b}"), m.get(f"latency_ms_b{b}_p90")
        if median:
            row[f"p50_ms_b{b}"], row[f"p90_ms_b{b}"] = median, p90
            row[f"items_per_s_b{b}"] = round(1000 * b / median, 1)
            if r.get(f"latency_ms_b{b}"):
                row[f"speedup_b{b}"] = round(r[f"latency_ms_b{b}"] / median, 2)
        if m.get(f"latency_ms_b{b}_real"):
            row[f"real_ms_b{b}"] = m[f"latency_ms_b{b}_real"]
    if m.get("latency_noisy_batches"):
        row["noisy"] = m["latency_noisy_batches"]


def derive_causal_lm(row: dict[str, Any], ref: dict | None, decode_batches: list[int]) -> None:
    """A causal LM's columns: perplexity and its change, agreement, TTFT, decode rates
    and the batch-1 speedup against the reference row."""
    m, r = row["metrics"], (ref or {}).get("metrics", {})
    for key in ("perplexity", "agreement", "next_token_agreement",
                "next_token_agreement_decisive", "ttft_ms",
                "eager_generate_tok_s_b1", "peak_rss_mb"):
        if m.get(key) is not None:
            row[key] = m[key]
    row.update({key: value for key, value in m.items()
                if key.startswith(LM_EVAL) and value is not None})  # evaluation.lm_eval
    if m.get("perplexity") and r.get("perplexity"):
        row["ppl_delta_pct"] = round(100 * (m["perplexity"] / r["perplexity"] - 1), 2)
    for b in decode_batches:
        if m.get(f"decode_tok_s_b{b}"):
            row[f"decode_tok_s_b{b}"] = m[f"decode_tok_s_b{b}"]
    if m.get("decode_tok_s_b1") and r.get("decode_tok_s_b1"):
        row["decode_speedup_b1"] = round(m["decode_tok_s_b1"] / r["decode_tok_s_b1"], 2)


RERANKER_QUALITY = ("ndcg_at_10", "mrr_at_10", "kendall_tau", "score_max_abs_diff")
EMBEDDING_QUALITY = re.compile(r"(fidelity|fidelity_p1|recall_at_\d+|knn_accuracy)(_\w+)?"
                               r"|mteb_\w+")  # evaluation.mteb: each task's main score


def derive_embedding(row: dict[str, Any]) -> None:
    """An embedding model's quality columns as measured: fidelity (mean cosine with the
    reference, and its 1st percentile), recall@k, k-NN accuracy, and the same at each
    Matryoshka width (`_d<N>`) and with each other prompt (`_<name>`); MTEB scores."""
    for key, value in row["metrics"].items():
        if value is not None and EMBEDDING_QUALITY.fullmatch(key):
            row[key] = value


def _header(manifest: Manifest) -> dict[str, Any]:
    env = manifest.environment
    cpu = env.get("cpu") or {}
    recipe = manifest.recipe
    return {"cpu": cpu.get("model"), "cores": cpu.get("cores"),
            "isa": [flag for flag, on in (cpu.get("isa") or {}).items() if on],
            "threads": env.get("threads"), "python": env.get("python"),
            "libraries": env.get("libraries") or {},
            "recipe": recipe.get("name"),
            "chain": [s.get("name") or s["kind"] for s in manifest.recipe_stages()],
            "model": (recipe.get("model") or {}).get("source"),
            "data": (recipe.get("data") or {}).get("source"),
            "eval_examples": manifest.data.get("eval")}


SECTION = "section.md"  # a stage's own part of report.md (a search's trials, say)


def _sections(run_dir: Path, manifest: Manifest) -> list[str]:
    """The `section.md` of every finished stage that wrote one, in stage order."""
    found = []
    for i, entry in enumerate(manifest.stages):
        path = run_dir / f"{i:02d}-{entry.kind}" / SECTION
        if (entry.finished_ok or entry.status == "failed") and path.is_file():
            found.append(path.read_text())
    return found


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file beside the manifest (loadtest.json, bench.json), or None."""
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


def write_reports(run_dir: str | Path) -> list[Path]:
    """Write report.json, report.md and report.png into the run folder; return the paths."""
    run_dir = Path(run_dir)
    report = build_report(run_dir)
    atomic_write_json(run_dir / "report.json", report)
    atomic_write_text(run_dir / "report.md", render_markdown(report))
    written = [run_dir / "report.json", run_dir / "report.md"]
    from compress.report.plot import plot_report

    png = plot_report(report, run_dir / "report.png")
    if png:
        written.append(png)
    return written


def compare(run_dirs: list[str | Path]) -> dict[str, Any]:
    """One report across runs: rows labelled `run/artifact`, columns of the first run's
    batch sizes (union of all)."""
    reports = [build_report(d) for d in run_dirs]
    batches = sorted({b for r in reports for b in r["batch_sizes"]})
    rows = []
    for report in reports:
        for row in report["rows"]:
            rows.append({**row, "name": f"{report['run']}/{row['name']}"})
    first = reports[0]
    return {**first, "run": " vs ".join(r["run"] for r in reports),
            "run_dir": ", ".join(r["run_dir"] for r in reports), "batch_sizes": batches,
            "rows": rows, "served": None, "fresh": None, "sections": [],
            "reference": ", ".join(f"{r['run']}/{r['reference']}" for r in reports),
            "runs": [{k: r[k] for k in ("run", "run_dir", "reference", "served")}
                     for r in reports]}

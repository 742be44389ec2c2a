"""Reports of run folders: one row per artifact, read from the manifest (no model is run).

`build_report` turns a run folder into a dict (what `report.json` holds); `render_table`,
`render_markdown` and `write_reports` present it; `compare` puts several runs in one table
with the best value of each column marked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compress.errors import UserError
from compress.runfolder import atomic_write_json, atomic_write_text, now, require_manifest

RUNTIMES = {"torchscript": "TorchScript", "onnx": "ONNX Runtime", "aoti": "AOTInductor",
            "tensorrt": "TensorRT"}
# (row key, header, digits, which way is better)
COLUMNS: tuple[tuple[str, str, int, str | None], ...] = (
    ("accuracy_pct", "acc %", 2, "high"),
    ("accuracy_delta_pt", "Δ pt", 2, None),
    ("macro_f1", "F1", 4, "high"),
)
SIZE_COLUMNS: tuple[tuple[str, str, int, str | None], ...] = (
    ("size_mb", "MB", 1, "low"),
    ("size_ratio", "size ×", 3, "low"),
    ("params_m", "params M", 2, None),  # int8 weights are buffers: a count, not a goal
    ("sparsity", "sparsity", 3, None),
)


def build_report(run_dir: str | Path, reference: str | None = None) -> dict[str, Any]:
    """The report of one run folder: header, rows (baseline, each stage), served figures.

    `reference` names the row deltas, ratios and speedups compare with (default: the first
    fine-tuned model when the recipe starts with finetune, else the baseline)."""
    run_dir = Path(run_dir)
    manifest = require_manifest(run_dir)
    recipe = manifest.get("recipe") or {}
    batches = ((recipe.get("evaluation") or {}).get("latency") or {}).get("batch_sizes") or []
    rows = []
    if manifest.get("baseline"):
        rows.append(_row("baseline", "baseline", manifest["baseline"], "PyTorch eager"))
    entries = manifest.get("stages") or []
    for i, stage in enumerate(recipe.get("stages") or []):
        name = stage.get("name") or stage["kind"]
        entry = entries[i] if i < len(entries) else None
        if entry is None or entry.get("name") != name:
            rows.append({"name": name, "kind": stage["kind"], "status": "not run",
                         "runtime": _runtime(stage, {}), "metrics": {}})
            continue
        rows.append(_row(name, stage["kind"], entry, _runtime(stage, entry.get("metrics") or {})))
    ref = _reference(rows, recipe, reference)
    fresh = _read_json(run_dir / "bench.json")
    for row in rows:
        _derive(row, ref, batches)
        figures = ((fresh or {}).get("artifacts") or {}).get(row["name"]) or {}
        for b in batches:
            if figures.get(f"latency_ms_b{b}"):
                row[f"fresh_p50_ms_b{b}"] = figures[f"latency_ms_b{b}"]
                row[f"fresh_p90_ms_b{b}"] = figures.get(f"latency_ms_b{b}_p90")
    return {"run": manifest.get("name"), "run_dir": str(run_dir), "generated": now(),
            "updated": manifest.get("updated"), "header": _header(manifest),
            "reference": ref["name"] if ref else None, "batch_sizes": batches,
            "seq_len": ((recipe.get("evaluation") or {}).get("latency") or {}).get("seq_len"),
            "rows": rows, "served": _read_json(run_dir / "loadtest.json"),
            "fresh": {k: fresh[k] for k in ("measured", "settings") if k in fresh}
            if fresh else None}


def _row(name: str, kind: str, entry: dict[str, Any], runtime: str) -> dict[str, Any]:
    outputs = entry.get("outputs") or []
    row = {"name": name, "kind": kind, "status": entry.get("status", "unknown"),
           "runtime": runtime, "metrics": dict(entry.get("metrics") or {}),
           "artifact": outputs[0]["path"] if outputs else None}
    if entry.get("error"):
        row["error"] = entry["error"]
    return row


def _runtime(stage: dict[str, Any], metrics: dict[str, Any]) -> str:
    kind = stage["kind"]
    if kind == "quantize":
        compiled = ", torch.compile" if stage.get("compile", True) else ""
        return f"PT2E int8 {stage.get('mode', 'static')}{compiled}"
    if kind == "compile":
        return "torch.compile"
    if kind == "export":
        fmt = stage.get("format", "")
        extra = {"onnx": f" int8 {stage['quantize']}" if stage.get("quantize") else "",
                 "tensorrt": f" {stage.get('precision', 'fp32')}"}.get(fmt, "")
        return RUNTIMES.get(fmt, fmt) + extra
    if kind == "package":
        served = metrics.get("served_format")
        return "TorchServe .mar" + (f" ({RUNTIMES.get(served, served)})" if served else "")
    return "PyTorch eager"


def _reference(rows: list[dict], recipe: dict, wanted: str | None) -> dict | None:
    measured = [r for r in rows if r["metrics"].get("accuracy") is not None]
    if wanted:
        for row in rows:
            if row["name"] == wanted:
                return row
        names = ", ".join(r["name"] for r in rows)
        raise UserError(f"--reference {wanted}: no such row (rows: {names})")
    stages = recipe.get("stages") or []
    if stages and stages[0]["kind"] == "finetune":
        first = stages[0].get("name") or "finetune"
        for row in measured:
            if row["name"] == first:
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
    if m.get("latency_noisy_batches"):
        row["noisy"] = m["latency_noisy_batches"]


def _header(manifest: dict[str, Any]) -> dict[str, Any]:
    env = manifest.get("environment") or {}
    cpu = env.get("cpu") or {}
    recipe = manifest.get("recipe") or {}
    return {"cpu": cpu.get("model"), "cores": cpu.get("cores"),
            "isa": [flag for flag, on in (cpu.get("isa") or {}).items() if on],
            "threads": env.get("threads"), "python": env.get("python"),
            "libraries": env.get("libraries") or {},
            "recipe": recipe.get("name"),
            "chain": [s.get("name") or s["kind"] for s in recipe.get("stages") or []],
            "model": (recipe.get("model") or {}).get("source"),
            "data": (recipe.get("data") or {}).get("source"),
            "eval_examples": (manifest.get("data") or {}).get("eval")}


def _read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file beside the manifest (loadtest.json, bench.json), or None."""
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


def columns(report: dict[str, Any]) -> list[tuple[str, str, int, str | None]]:
    """The table's columns for this report's batch sizes: (row key, header, digits, which
    way is better). Latency cells show p50 / p90; the best mark goes by p50."""
    cols = list(COLUMNS)
    for b in report["batch_sizes"]:
        cols.append((f"p50_ms_b{b}", f"b{b} ms p50/p90", 2, "low"))
    if report["batch_sizes"]:
        top = max(report["batch_sizes"])
        if any(r.get(f"fresh_p50_ms_b{top}") for r in report["rows"]):
            cols.append((f"fresh_p50_ms_b{top}", f"fresh process b{top} ms", 2, "low"))
        cols += [(f"items_per_s_b{top}", f"items/s b{top}", 1, "high"),
                 (f"speedup_b{top}", f"speedup b{top}", 2, "high")]
    return cols + list(SIZE_COLUMNS)


def cell(value: Any, digits: int) -> str:
    """A table cell: numbers rounded, missing values as '-'."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def row_cells(row: dict[str, Any], cols: list, best: dict, mark: str) -> list[str]:
    """The label cells and one cell per column; `mark` ("**{}**" or "[bold green]{}[/]")
    wraps a column's best value."""
    cells = [row["name"], row["runtime"], row["status"] + (" (noisy)" if row.get("noisy")
                                                           else "")]
    for key, _, digits, _ in cols:
        text = cell(row.get(key), digits)
        if "p50_ms_" in key and row.get(key) is not None:
            text += " / " + cell(row.get(key.replace("p50", "p90")), digits)
        won = key in best and row.get(key) is not None and row.get(key) == best[key]
        cells.append(mark.format(text) if won else text)
    return cells


def best_values(rows: list[dict], cols: list[tuple[str, str, int, str | None]]) -> dict:
    """The best value of each column with a direction (max or min over rows that have it)."""
    best = {}
    for key, _, _, better in cols:
        values = [r[key] for r in rows if r.get(key) is not None and r.get("status") != "failed"]
        if better and values:
            best[key] = max(values) if better == "high" else min(values)
    return best


def header_lines(report: dict[str, Any]) -> list[str]:
    """Plain lines: hardware, libraries, recipe, reference row."""
    h = report["header"]
    libs = h["libraries"]
    shown = ", ".join(f"{k} {libs[k]}" for k in ("torch", "torchao", "transformers",
                                                  "onnxruntime", "torchserve") if k in libs)
    lines = [f"run {report['run']} ({report['run_dir']}), recipe {h['recipe']}: "
             + " -> ".join(h["chain"]),
             f"model {h['model']}, data {h['data']} ({h['eval_examples']} eval examples)",
             f"CPU {h['cpu']}, {h['cores']} cores, {h['threads']} threads, ISA "
             + (" ".join(h["isa"]) or "-"),
             f"Python {h['python']}, {shown}"]
    if report.get("fresh"):
        lines.append(f"fresh process: each artifact timed again alone in a new Python process "
                     f"(compress bench, {report['fresh'].get('measured')})")
    if report["reference"]:
        lines.append(f"Δ, size × and speedup against: {report['reference']}; latency is the "
                     f"median (p50) and p90 per batch at sequence length {report['seq_len']}")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """`report.md`: the header as a list, the table, served figures and failures."""
    cols = columns(report)
    rows = report["rows"]
    best = best_values(rows, cols)
    lines = [f"# compress report: {report['run']}", ""]
    lines += [f"- {line}" for line in header_lines(report)] + [""]
    head = ["artifact", "runtime", "status"] + [h for _, h, _, _ in cols]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        lines.append("| " + " | ".join(row_cells(row, cols, best, "**{}**")) + " |")
    lines += _served_lines(report, markdown=True)
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines += ["", "Failed stages:"] + [f"- {r['name']}: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


def served_table(report: dict[str, Any]) -> tuple[list[str], list[str], list[list[str]]]:
    """(title lines, headers, rows) of the load test's figures; empty when none ran."""
    served = report.get("served")
    if not served:
        return [], [], []
    titles = [f"Served endpoint {served.get('url')} (load test of {served.get('measured')})"]
    settings = served.get("server_settings")
    if settings:
        titles.append(f"workers {settings.get('maxWorkers')} x "
                      f"{settings.get('threads_per_worker')} threads, batch size "
                      f"{settings.get('batchSize')}, max batch delay "
                      f"{settings.get('maxBatchDelay')} ms")
    head = ["concurrency", "requests", "errors", "req/s", "p50 ms", "p90 ms", "p99 ms",
            "mean batch", "max batch"]
    keys = ["concurrency", "requests", "errors", "throughput_rps", "latency_ms_p50",
            "latency_ms_p90", "latency_ms_p99", "batch_size_mean", "batch_size_max"]
    rows = [[cell(run.get(k), 2) for k in keys] for run in served.get("runs", [])]
    if served.get("throughput_ratio") is not None:
        titles.append(f"throughput at the highest / lowest concurrency: "
                      f"{served['throughput_ratio']}x")
    return titles, head, rows


def _served_lines(report: dict[str, Any], markdown: bool) -> list[str]:
    titles, head, rows = served_table(report)
    if not titles:
        return []
    lines = ["", *titles, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def render_table(report: dict[str, Any], console=None) -> None:
    """The report as a rich table in the terminal (best values in bold green)."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        if not console.is_terminal:  # piped: never squeeze the table to 80 columns
            console = Console(width=240)
    cols = columns(report)
    rows = report["rows"]
    best = best_values(rows, cols)
    for line in header_lines(report):
        console.print(line, highlight=False)
    table = Table(header_style="bold")
    for head in ["artifact", "runtime", "status"] + [h for _, h, _, _ in cols]:
        label = head in ("artifact", "runtime", "status")
        table.add_column(head, justify="left" if label else "right", no_wrap=not label)
    for row in rows:
        table.add_row(*row_cells(row, cols, best, "[bold green]{}[/]"))
    console.print(table)
    titles, head, served_rows = served_table(report)
    if titles:
        for line in titles:
            console.print(line, highlight=False)
        served = Table(header_style="bold")
        for name in head:
            served.add_column(name, justify="right")
        for cells in served_rows:
            served.add_row(*cells)
        console.print(served)
    for row in rows:
        if row.get("error"):
            console.print(f"[red]{row['name']} failed:[/] {row['error']}", highlight=False)


def write_reports(run_dir: str | Path) -> list[Path]:
    """Write report.json, report.md and report.png into the run folder; return the paths."""
    run_dir = Path(run_dir)
    report = build_report(run_dir)
    atomic_write_json(run_dir / "report.json", report)
    atomic_write_text(run_dir / "report.md", render_markdown(report))
    written = [run_dir / "report.json", run_dir / "report.md"]
    from compress.report_plot import plot_report

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
            "rows": rows, "served": None, "fresh": None,
            "reference": ", ".join(f"{r['run']}/{r['reference']}" for r in reports),
            "runs": [{k: r[k] for k in ("run", "run_dir", "reference", "served")}
                     for r in reports]}

"""Presenting a report (the dict `compress.report.build.build_report` makes): the terminal table,
Markdown, and the load test's served figures."""

from __future__ import annotations

import re
from typing import Any

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


LM_EVAL = "lm_eval_"  # a causal LM's lm-eval scores: lm_eval_<task>_<metric>
MTEB = "mteb_"  # an embedding model's MTEB scores: mteb_<task>_<main score>
CAUSAL_LM_COLUMNS: tuple[tuple[str, str, int, str | None], ...] = (
    ("perplexity", "ppl", 2, "low"),
    ("ppl_delta_pct", "Δ ppl %", 2, None),
    ("agreement", "greedy agree", 3, "high"),
    ("next_token_agreement", "next-token agree", 3, "high"),
    ("next_token_agreement_decisive", "decisive agree", 3, "high"),
    ("ttft_ms", "TTFT ms", 1, "low"),
    ("eager_generate_tok_s_b1", "generate tok/s b1", 1, None),
)


def causal_lm_columns(report: dict[str, Any]) -> list[tuple[str, str, int, str | None]]:
    """A causal LM's columns: quality, then decode rates per batch size and the speedup."""
    cols = list(CAUSAL_LM_COLUMNS)
    for b in report.get("decode_batch_sizes") or []:
        cols.append((f"decode_tok_s_b{b}", f"decode tok/s b{b}", 1, "high"))
    scored = sorted({k for row in report.get("rows", []) for k in row
                     if k.startswith(LM_EVAL)})  # evaluation.lm_eval: each task's metrics
    cols += [(key, key.removeprefix(LM_EVAL), 4,
              "low" if "perplexity" in key or key.endswith("bits_per_byte") else "high")
             for key in scored]
    cols += [("decode_speedup_b1", "speedup b1", 2, "high"),
             ("peak_rss_mb", "peak RSS MB", 0, "low")]
    return cols + [c for c in SIZE_COLUMNS if c[0] != "sparsity"]


EMBEDDING_COLUMNS: tuple[tuple[str, str, int, str | None], ...] = (
    ("fidelity", "cosine", 4, "high"),
    ("fidelity_p1", "cosine p1", 4, "high"),
    ("recall_at_10", "recall@10", 3, "high"),
    ("knn_accuracy", "k-NN acc", 4, "high"),
)


def embedding_columns(report: dict[str, Any]) -> list[tuple[str, str, int, str | None]]:
    """An embedding model's quality columns: cosine with the reference, recall@10, k-NN
    accuracy; then recall@10 (and cosine) at each Matryoshka width, widest first, and with
    each other prompt, where a row has them; then each MTEB task's main score."""
    keys = {k for row in report["rows"] for k in row}
    found = [re.fullmatch(r"recall_at_10_(?:d(\d+)|(\w+))", k) for k in keys]
    widths = sorted({int(m[1]) for m in found if m and m[1]}, reverse=True)
    prompted = sorted(m[2] for m in found if m and m[2])
    cols = list(EMBEDDING_COLUMNS)
    for width in widths:
        cols += [(f"fidelity_d{width}", f"cosine d{width}", 4, "high"),
                 (f"recall_at_10_d{width}", f"recall@10 d{width}", 3, "high")]
    cols += [(f"recall_at_10_{name}", f"recall@10 {name}", 3, "high") for name in prompted]
    scored = sorted(k for k in keys if k.startswith(MTEB))  # evaluation.mteb
    return cols + [(key, key.removeprefix(MTEB), 4, "high") for key in scored]


RERANKER_COLUMNS: tuple[tuple[str, str, int, str | None], ...] = (
    ("ndcg_at_10", "nDCG@10", 4, "high"),
    ("mrr_at_10", "MRR@10", 4, "high"),
    ("kendall_tau", "Kendall τ", 4, "high"),
    ("score_max_abs_diff", "max Δ score", 4, "low"),
)


def columns(report: dict[str, Any]) -> list[tuple[str, str, int, str | None]]:
    """The table's columns for this report's batch sizes: (row key, header, digits, which
    way is better). Latency cells show p50 / p90; the best mark goes by p50."""
    if report.get("task") == "causal-lm":
        return causal_lm_columns(report)
    cols = (embedding_columns(report) if report.get("task") == "embedding"
            else list(RERANKER_COLUMNS) if report.get("task") == "reranking" else list(COLUMNS))
    for b in report["batch_sizes"]:
        cols.append((f"p50_ms_b{b}", f"b{b} ms p50/p90", 2, "low"))
    for b in report["batch_sizes"]:  # the eval split's own sentences, padded per batch
        if any(r.get(f"real_ms_b{b}") for r in report["rows"]):
            cols.append((f"real_ms_b{b}", f"b{b} real-length ms", 2, "low"))
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
                     f"median (p50) and p90 per batch at sequence length {report['seq_len']}; "
                     f"real-length: the eval split's sentences in order, padded per batch, "
                     f"median per batch")
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
    for text in report.get("sections") or []:
        lines += ["", text.rstrip()]
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



"""`compress report`, `compress bench` and `compress compare`: thin commands over
compress.report.build and compress.report.rebench."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--format", "fmt", type=click.Choice(["table", "markdown", "json"]),
              default="table", show_default=True, help="Terminal table, Markdown or JSON.")
@click.option("--output", type=click.Path(dir_okay=False), help="Write to FILE instead of "
              "printing.")
@click.option("--reference", help="Row that deltas, size ratios and speedups compare with "
              "(default: the fine-tuned model, else the baseline).")
def report(run_dir: str, fmt: str, output: str | None, reference: str | None) -> None:
    """Accuracy, latency, size and speedup of every artifact of RUN_DIR, from its manifest.

    \b
    Also rewrites report.json, report.md and report.png in the run folder (no model runs).

    \b
    Examples:
      compress report runs/bert_int8
      compress report runs/bert_int8 --format markdown --output bert_int8.md
    """
    from compress.report.build import build_report, write_reports

    data = build_report(run_dir, reference)
    write_reports(run_dir)
    _emit(data, fmt, output)


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--stage", "stages", multiple=True, metavar="NAME",
              help="Only this artifact (stage name or index; repeatable).")
@click.option("--iters", type=click.IntRange(1), help="Timed iterations (default: the recipe's).")
@click.option("--warmup", type=click.IntRange(0), help="Untimed iterations first.")
@click.option("--threads", type=click.IntRange(1), help="Intra-op threads.")
def bench(run_dir: str, stages: tuple[str, ...], iters: int | None, warmup: int | None,
          threads: int | None) -> None:
    """Time every artifact of RUN_DIR again, each in a fresh Python process.

    \b
    Uses the recipe's latency settings (batch sizes, lengths, warm-up, iterations) unless
    overridden; writes <run>/bench.json, which the report shows beside the in-run figures.

    \b
    Examples:
      compress bench runs/bert_int8
      compress bench runs/bert_int8 --stage int8_aoti --iters 50 --threads 2
    """
    from compress.report.build import write_reports
    from compress.report.rebench import bench_fresh

    result = bench_fresh(run_dir, list(stages) or None, iters, warmup, threads,
                         echo=lambda m: click.echo(m, err=True))
    for name in result["timed"]:
        figures = result["artifacts"][name]
        if "error" in figures:
            click.echo(f"{name}: error: {figures['error']}")
            continue
        shown = ", ".join(f"b{k.removeprefix('latency_ms_b')} {v} ms"
                          for k, v in figures.items()
                          if k.startswith("latency_ms_b") and k.removeprefix(
                              "latency_ms_b").isdigit())
        click.echo(f"{name}: {shown}")
    write_reports(run_dir)
    click.echo(f"written: {Path(run_dir) / 'bench.json'} (compress report {run_dir})")


@click.command()
@click.argument("run_dirs", nargs=-1, required=True,
                type=click.Path(exists=True, file_okay=False))
@click.option("--format", "fmt", type=click.Choice(["table", "markdown", "json"]),
              default="table", show_default=True, help="Terminal table, Markdown or JSON.")
@click.option("--output", type=click.Path(dir_okay=False), help="Write to FILE instead of "
              "printing.")
def compare(run_dirs: tuple[str, ...], fmt: str, output: str | None) -> None:
    """The report table across runs, the best value of each column marked.

    \b
    Example:
      compress compare runs/bert_int8 runs/bert_onnx_int8
    """
    from compress.report.build import compare as compare_runs

    if len(run_dirs) < 2:
        raise click.UsageError("give at least two run folders to compare")
    _emit(compare_runs(list(run_dirs)), fmt, output)


def _emit(data: dict, fmt: str, output: str | None) -> None:
    from compress.report.build import render_markdown, render_table
    from compress.runfolder.files import atomic_write_text

    if fmt == "table" and output is None:
        render_table(data)
        return
    if fmt == "json":
        text = json.dumps(data, indent=2) + "\n"
    elif fmt == "markdown":
        text = render_markdown(data)
    else:
        from io import StringIO

        from rich.console import Console

        buffer = StringIO()
        render_table(data, Console(file=buffer, width=250, no_color=True))
        text = buffer.getvalue()
    if output:
        atomic_write_text(Path(output), text)
        click.echo(f"written: {output}")
    else:
        click.echo(text, nl=False)

"""The `compress` command line: thin click commands over the library.

User errors exit 2 and failed stages exit 1, each with one line per problem, no traceback.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from compress.errors import CompressError, StageError, UserError, one_line
from compress.recipe import load_recipe


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="compress")
def cli() -> None:
    """Compress, export and serve PyTorch models from one YAML recipe.

    \b
    Examples:
      compress validate recipes/bert_finetune.yaml
      compress run recipes/bert_finetune.yaml stages.0.max_steps=50
      compress stages
    """


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--output-dir", help="Parent folder of the run folder (overrides output_dir).")
@click.option("--force", is_flag=True, help="Run every stage again, ignoring the cache.")
@click.option("--from-stage", metavar="N|KIND",
              help="Run again from this stage on (index, kind or name).")
@click.option("--nproc", type=click.IntRange(1), help="Processes on this machine: run "
              "through torchrun with data-parallel training (DDP).")
@click.option("--nnodes", type=click.IntRange(1), default=1, show_default=True,
              help="Machines in the job (with --nproc).")
@click.option("--node-rank", type=click.IntRange(0), default=0, show_default=True,
              help="This machine's index (with --nnodes > 1).")
@click.option("--master-addr", help="Address of node 0 (with --nnodes > 1).")
@click.option("--master-port", type=click.IntRange(1, 65535), default=29500,
              show_default=True, help="Port of node 0 (with --nnodes > 1).")
def run(recipe: str, overrides: tuple[str, ...], output_dir: str | None, force: bool,
        from_stage: str | None, nproc: int | None, nnodes: int, node_rank: int,
        master_addr: str | None, master_port: int) -> None:
    """Run RECIPE; KEY=VALUE overrides any recipe option.

    \b
    The run folder <output_dir>/<name>/ holds recipe.yaml, manifest.json and one folder
    per stage. Re-running skips stages whose config and input are unchanged; a run that
    was interrupted resumes from its last completed stage (training from its checkpoint).

    \b
    Examples:
      compress run recipes/bert_finetune.yaml
      compress run recipes/bert_finetune.yaml stages.0.max_steps=50 data.eval.max_samples=200
      compress run recipes/cnn_digits.yaml --output-dir /tmp/runs --from-stage finetune
    """
    from compress.pipeline import run_recipe

    extra = [f"output_dir={output_dir}"] if output_dir else []
    parsed = load_recipe(recipe, list(overrides) + extra, check_sources=True)
    if nproc and "WORLD_SIZE" not in os.environ:  # not yet inside torchrun: launch it
        from compress.launch import torchrun

        args = [recipe, *overrides, *(["--output-dir", output_dir] if output_dir else []),
                *(["--force"] if force else []),
                *(["--from-stage", from_stage] if from_stage else [])]
        sys.exit(torchrun(args, nproc, nnodes, node_rank, master_addr, master_port,
                          echo=lambda m: click.echo(m, err=True)))
    run_dir = run_recipe(parsed, force=force, from_stage=from_stage)
    if int(os.environ.get("RANK", "0")) == 0:
        click.echo(f"run folder: {run_dir}")


@cli.command()
@click.argument("items", nargs=-1, required=True, metavar="RECIPE... [KEY=VALUE...]")
def validate(items: tuple[str, ...]) -> None:
    """Check each RECIPE (schema, stage order, model and data sources) without running
    anything; KEY=VALUE overrides apply to every recipe. Every problem of every file is
    printed, one line each.

    \b
    Examples:
      compress validate recipes/bert_finetune.yaml stages.0.max_steps=50
      compress validate recipes/*.yaml
    """
    from compress.stages.chain import hardware_needed
    from compress.stages.spec import HARDWARE

    overrides = [i for i in items if "=" in i and not Path(i).exists()]
    recipes = [i for i in items if i not in overrides]
    if not recipes:
        raise click.UsageError("give at least one recipe file")
    problems: list[str] = []
    for path in recipes:
        try:
            parsed = load_recipe(path, overrides, check_sources=True)
        except UserError as exc:
            problems += [f"{path}: {m}" if not m.startswith(path) else m for m in exc.messages]
            continue
        kinds = " -> ".join(s.name or s.kind for s in parsed.stages) or "no stages"
        click.echo(f"{path}: ok ({parsed.name}: {kinds})")
        for i, need in hardware_needed(parsed):
            click.echo(f"{path}: note: the run will need {HARDWARE[need][0]} "
                       f"(stages.{i} {parsed.stages[i].kind})")
    if problems:
        raise UserError(problems)


@cli.command()
@click.argument("kind", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the options as JSON.")
def stages(kind: str | None, as_json: bool) -> None:
    """List every stage kind (or KIND) with its options, nested ones included, their
    types, allowed values, bounds, real defaults and docs.

    \b
    Examples:
      compress stages
      compress stages quantize --json
    """
    from compress.cli_stages import describe_kinds, render_kinds

    described = describe_kinds(kind)
    if as_json:
        click.echo(json.dumps(described, indent=2))
    else:
        click.echo(render_kinds(described))


@cli.command()
def schema() -> None:
    """Print the recipe JSON Schema (for editor completion and checks).

    \b
    Example:
      compress schema > recipe.schema.json
    """
    from compress.recipe import Recipe

    click.echo(json.dumps(Recipe.model_json_schema(), indent=2))


@cli.command()
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
    from compress.report import build_report, write_reports

    data = build_report(run_dir, reference)
    write_reports(run_dir)
    _emit(data, fmt, output)


@cli.command()
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
    from compress.rebench import bench_fresh
    from compress.report import write_reports

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


@cli.command()
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
    from compress.report import compare as compare_runs

    if len(run_dirs) < 2:
        raise click.UsageError("give at least two run folders to compare")
    _emit(compare_runs(list(run_dirs)), fmt, output)


def _emit(data: dict, fmt: str, output: str | None) -> None:
    from compress.report import render_markdown, render_table
    from compress.runfolder import atomic_write_text

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


@cli.command()
@click.argument("target", required=False, type=click.Path(exists=True))
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535),
              help="Inference port on 127.0.0.1.")
@click.option("--workers", type=click.IntRange(1, 64), help="Worker processes (default: "
              "the archive's).")
@click.option("--batch-size", type=click.IntRange(1, 1024),
              help="Largest batch TorchServe forms (default: the archive's).")
@click.option("--max-batch-delay", type=click.IntRange(0, 10_000), metavar="MS",
              help="Milliseconds TorchServe waits to fill a batch (default: the archive's).")
@click.option("--no-auth", is_flag=True, help="Turn TorchServe's token authorization off.")
@click.option("--enable-model-api", is_flag=True,
              help="Allow registering and scaling models through the management API.")
@click.option("--timeout", default=300, show_default=True, type=click.IntRange(1),
              help="Seconds to wait for a READY worker.")
@click.option("--stop", is_flag=True, help="Stop the server of TARGET (or every server "
              "compress started when TARGET is omitted).")
def serve(target: str | None, port: int, workers: int | None, batch_size: int | None,
          max_batch_delay: int | None, no_auth: bool, enable_model_api: bool, timeout: int,
          stop: bool) -> None:
    """Serve TARGET (a run folder with a package stage, or a .mar) with TorchServe.

    \b
    Every listener binds 127.0.0.1; token authorization is on unless --no-auth. The
    server's files (config, logs, pid, tokens) live in <run>/serve/. Returns once a
    worker is READY and prints a curl command; stop it with --stop.

    \b
    Examples:
      compress serve runs/bert_int8
      compress serve runs/bert_int8 --port 8081 --batch-size 16 --max-batch-delay 10
      compress serve --stop runs/bert_int8
    """
    from serve import server

    if stop:
        stopped = server.stop_servers(target)
        click.echo(f"stopped {len(stopped)} server(s)" + "".join(f"\n  {s}" for s in stopped))
        return
    if target is None:
        raise click.UsageError("give a run folder or a .mar to serve (or --stop)")
    info = server.start(server.resolve_target(target), port=port, workers=workers,
                        batch_size=batch_size, max_batch_delay_ms=max_batch_delay,
                        auth=not no_auth, model_api=enable_model_api, timeout_s=timeout,
                        echo=lambda m: click.echo(m, err=True))
    settings = info["settings"]
    click.echo(f"serving {info['model_name']} at {info['url']}")
    click.echo(f"  workers {settings['maxWorkers']} x {settings['threads_per_worker']} "
               f"threads, batch size {settings['batchSize']}, max batch delay "
               f"{settings['maxBatchDelay']} ms; logs in {info['serve_dir']}/logs")
    if info.get("token"):
        click.echo(f"  token (also in {info['serve_dir']}/key_file.json): {info['token']}")
    click.echo(f"  try: {server.curl_example(info)}")
    click.echo(f"  stop: compress serve --stop {target}")


@cli.command()
@click.argument("url")
@click.option("--concurrency", default="1,8,32", show_default=True,
              help="Comma-separated numbers of requests in flight.")
@click.option("--requests", "n_requests", default=200, show_default=True,
              type=click.IntRange(1, 100_000), help="Requests per concurrency level.")
@click.option("--warmup", default=8, show_default=True, type=click.IntRange(0),
              help="Requests sent first at each level and not counted.")
@click.option("--texts", type=click.Path(exists=True, dir_okay=False),
              help="A text file: one request text per line (default: a few review sentences).")
@click.option("--token", help="Bearer token (default: the one in --run's serve folder).")
@click.option("--run", "run_dir", type=click.Path(exists=True, file_okay=False),
              help="Run folder: its server's token is used and loadtest.json written there.")
def loadtest(url: str, concurrency: str, n_requests: int, warmup: int, texts: str | None,
             token: str | None, run_dir: str | None) -> None:
    """Load-test a served model at URL over loopback: throughput, latency percentiles,
    errors and the batch sizes TorchServe formed.

    \b
    Examples:
      compress loadtest http://127.0.0.1:8080/predictions/bert_int8 --run runs/bert_int8
      compress loadtest http://127.0.0.1:8080/predictions/bert_int8 --concurrency 1,32 \\
          --requests 500 --token TOKEN
    """
    from serve.loadtest import format_table, load_payloads, record_result, sweep
    from serve.server import token_of

    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"--concurrency {concurrency!r}: expected numbers like 1,8,32") from None
    token = token or (token_of(run_dir) if run_dir else None)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    result = sweep(url, levels, n_requests, load_payloads(texts), headers=headers,
                   warmup=warmup)
    click.echo(format_table(result))
    if run_dir:
        click.echo(f"written: {record_result(run_dir, result)}")
    failed = sum(r.get("errors", 0) for r in result.get("runs", []))
    sent = sum(r.get("requests", 0) for r in result.get("runs", []))
    if failed:
        hint = "" if token else " (is token authorization on? pass --token or --run RUN_DIR)"
        raise CompressError(f"{failed} of {sent} requests failed{hint}")


def main() -> None:
    """Entry point: run the CLI and turn our errors into exit codes without tracebacks."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:  # Ctrl-C or SIGTERM (torchrun stopping a rank)
        click.echo("interrupted: re-run the same command to resume", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2 if isinstance(exc, click.UsageError) else exc.exit_code)
    except UserError as exc:
        for message in exc.messages:
            click.echo(f"error: {message}", err=True)
        sys.exit(exc.exit_code)
    except StageError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except CompressError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("interrupted: re-run the same command to resume", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - a bug: one line here, the traceback in a log
        click.echo(f"error: {one_line(exc)} (details in {_write_crash_log()})", err=True)
        sys.exit(1)


def _write_crash_log() -> Path:
    """Write the current exception's traceback to a log file; its path."""
    import tempfile
    import time
    import traceback

    base = os.environ.get("COMPRESS_STATE_DIR") or os.path.expanduser("~/.local/state/compress")
    name = f"compress-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    for folder in (Path(base) / "logs", Path(tempfile.gettempdir())):
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(traceback.format_exc())
            return folder / name
        except OSError:
            continue
    return Path(name)

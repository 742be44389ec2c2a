"""The `compress` command line: thin click commands over the library.

User errors exit 2 and failed stages exit 1, each with one line per problem, no traceback.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import click

from compress import __version__
from compress.cli.logs import divert_library_warnings, write_crash_log
from compress.errors import CompressError, StageError, UserError, one_line
from compress.recipe.schema import load_recipe


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, package_name="compress-pipeline")
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
              help="This machine's index (with --nnodes > 1): node 0 hosts torchrun's "
              "rendezvous.")
@click.option("--master-addr",
              help="Address of node 0, where the machines meet (with --nnodes > 1).")
@click.option("--master-port", type=click.IntRange(1, 65535), default=29500,
              show_default=True, help="Port of the rendezvous on node 0 (with --nnodes > 1).")
@click.option("--max-restarts", type=click.IntRange(0, 100), default=0, show_default=True,
              help="With --nproc: times torchrun starts every rank again after one dies; "
              "the run resumes from the last checkpoint.")
@click.option("--oversubscribe", is_flag=True,
              help="Allow --nproc above this machine's cores (or GPUs).")
def run(recipe: str, overrides: tuple[str, ...], output_dir: str | None, force: bool,
        from_stage: str | None, nproc: int | None, nnodes: int, node_rank: int,
        master_addr: str | None, master_port: int, max_restarts: int,
        oversubscribe: bool) -> None:
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
    extra = [f"output_dir={output_dir}"] if output_dir else []
    parsed = load_recipe(recipe, list(overrides) + extra, check_sources=True)  # before torch
    from compress.pipeline.loop import check_hardware, run_recipe

    check_hardware(parsed)  # here too, so torchrun is not launched for a run that cannot go
    if max_restarts and not nproc:
        raise UserError("--max-restarts restarts torchrun's ranks: use it with --nproc N")
    if nproc and "WORLD_SIZE" not in os.environ:  # not yet inside torchrun: launch it
        from compress.distributed.launch import torchrun

        args = [recipe, *overrides, *(["--output-dir", output_dir] if output_dir else []),
                *(["--force"] if force else []),
                *(["--from-stage", from_stage] if from_stage else [])]
        sys.exit(torchrun(args, nproc, nnodes, node_rank, master_addr, master_port,
                          echo=lambda m: click.echo(m, err=True), max_restarts=max_restarts,
                          oversubscribe=oversubscribe))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart:  # torchrun started the ranks again: go on where the run stopped
        force, from_stage = False, None
        if int(os.environ.get("RANK", "0")) == 0:
            click.echo(f"restart {restart}: resuming the run (training from its last "
                       f"checkpoint)", err=True)
    run_dir = run_recipe(parsed, force=force, from_stage=from_stage)
    if int(os.environ.get("RANK", "0")) == 0:
        click.echo(f"run folder: {run_dir}")
    if "WORLD_SIZE" in os.environ:  # a torchrun rank whose work is saved: leave now
        _leave_without_teardown()


def _leave_without_teardown() -> None:
    """Exit 0 without C++ static destructors: after the process group is gone, gloo's
    threads can still abort the process at interpreter exit ("terminate called without
    an active exception", SIGABRT), which torchrun reports as a failed job."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    from compress.recipe.chain import hardware_needed
    from compress.recipe.datasets import resolve_data
    from compress.recipe.registry import HARDWARE

    overrides = [i for i in items if _is_override(i)]
    recipes = [i for i in items if not _is_override(i)]
    if not recipes:
        raise click.UsageError("give at least one recipe file")
    failed = 0
    for path in recipes:  # every file is checked; its problems are printed as it is done
        try:
            parsed = load_recipe(path, overrides, check_sources=True)
        except UserError as exc:
            failed += 1
            for message in exc.messages:
                click.echo(f"error: {_located(path, message)}", err=True)
            continue
        kinds = " -> ".join(s.name or s.kind for s in parsed.stages) or "no stages"
        click.echo(f"{path}: ok ({parsed.name}: {kinds})")
        if resolve_data(parsed.data.source).kind == "hub":
            click.echo(f"{path}: note: data.source '{parsed.data.source}' is read from the "
                       f"Hugging Face hub, which validate does not reach: it cannot check the "
                       f"id offline (set COMPRESS_DATA_DIR to a folder holding "
                       f"<id>/<split>.tsv to read a local copy)")
        for i, need in hardware_needed(parsed):
            text, present = HARDWARE[need]
            missing = "" if present() else "; none found on this machine"
            click.echo(f"{path}: note: the run will need {text} "
                       f"(stages.{i} {parsed.stages[i].kind}){missing}")
    if failed:
        raise SystemExit(UserError.exit_code)


def _is_override(item: str) -> bool:
    """KEY=VALUE (a dotted key) and not an existing file: an override, else a recipe path."""
    return bool(re.match(r"[A-Za-z_][\w.-]*=", item)) and not Path(item).is_file()


def _located(path: str, message: str) -> str:
    """`path: message`, the file named once and as the user spelled it."""
    for spelled in (path, str(Path(path))):
        if message.startswith(spelled + ":"):
            return path + message[len(spelled):]
    return f"{path}: {message}"


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
    from compress.cli.stages import describe_kinds, render_kinds

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
    from compress.recipe.schema import Recipe

    click.echo(json.dumps(Recipe.model_json_schema(), indent=2))


from compress.cli.evaluation_harness import mteb  # noqa: E402
from compress.cli.reports import bench, compare, report  # noqa: E402
from compress.cli.search import search  # noqa: E402
from compress.cli.serve import loadtest, serve  # noqa: E402

for _command in (search, report, bench, compare, serve, loadtest, mteb):
    cli.add_command(_command)


def main() -> None:
    """Entry point: run the CLI and turn our errors into exit codes without tracebacks."""
    divert_library_warnings()
    try:
        code = cli.main(standalone_mode=False)  # a command's ctx.exit(n) returns n here
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
        log = write_crash_log()
        where = f"details in {log}" if log else "no log could be written"
        click.echo(f"error: {one_line(exc)} ({where})", err=True)
        sys.exit(1)
    if isinstance(code, int) and code:
        sys.exit(code)

"""The `compress` command line: thin click commands over the library.

User errors exit 2 and failed stages exit 1, each with one line per problem, no traceback.
"""

from __future__ import annotations

import json
import sys

import click

from compress.errors import StageError, UserError
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
def run(recipe: str, overrides: tuple[str, ...], output_dir: str | None, force: bool,
        from_stage: str | None) -> None:
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
    parsed = load_recipe(recipe, list(overrides) + extra)
    run_dir = run_recipe(parsed, force=force, from_stage=from_stage)
    click.echo(f"run folder: {run_dir}")


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
def validate(recipe: str, overrides: tuple[str, ...]) -> None:
    """Check RECIPE (schema, stage order, model and data sources) without running anything.

    \b
    Example:
      compress validate recipes/bert_finetune.yaml stages.0.max_steps=50
    """
    from compress.sources import check_recipe_sources

    parsed = load_recipe(recipe, list(overrides))
    check_recipe_sources(parsed)
    kinds = " -> ".join(s.name or s.kind for s in parsed.stages) or "no stages"
    click.echo(f"{recipe}: ok ({parsed.name}: {kinds})")


@cli.command()
def stages() -> None:
    """List every stage kind with its options, types, defaults and docs.

    \b
    Example:
      compress stages
    """
    from compress.stages.configs import STAGE_CONFIGS, stage_doc

    for kind, cls in STAGE_CONFIGS.items():
        click.echo(click.style(kind, bold=True) + f": {stage_doc(kind)}")
        for name, field in cls.model_fields.items():
            if name == "kind":
                continue
            kind_text = _type_name(field.annotation)
            default = "required" if field.is_required() else f"default {field.default!r}"
            click.echo(f"  {name:<18} {kind_text:<14} {default:<20} {field.description or ''}")
        click.echo("")


@cli.command()
def schema() -> None:
    """Print the recipe JSON Schema (for editor completion and checks).

    \b
    Example:
      compress schema > recipe.schema.json
    """
    from compress.recipe import Recipe

    click.echo(json.dumps(Recipe.model_json_schema(), indent=2))


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("NoneType", "None")


def main() -> None:
    """Entry point: run the CLI and turn our errors into exit codes without tracebacks."""
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
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
    except KeyboardInterrupt:
        click.echo("interrupted: re-run the same command to resume", err=True)
        sys.exit(130)

"""The evaluation harnesses' command lines: `compress-lm-eval` (lm-eval's own CLI with the
`compress` model registered, `compress.families.causal_lm.evaluation_harness`, so that
`--model compress --model_args folder=<export folder>` scores a compress export; every
other argument is lm-eval's) and `compress mteb` (MTEB tasks for an embedding export folder
or a served `/v1/embeddings`, `compress.families.embedding.evaluation_harness`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from compress.errors import UserError

EVAL_EXTRA = "pip install 'compress-pipeline[eval]'"


def main() -> None:
    """`compress-lm-eval`: lm-eval's command line, `--model compress` registered."""
    try:
        from compress.families.causal_lm import evaluation_harness
    except ImportError as exc:
        print(f"error: lm-eval is not installed ({exc}): {EVAL_EXTRA}", file=sys.stderr)
        raise SystemExit(2) from None
    evaluation_harness.main()


@click.command()
@click.argument("target")
@click.option("--tasks", default="SST2LocalClassification,SST2KnownItemRetrieval",
              show_default=True, help="Comma-separated MTEB task names: the local ones, or "
              "any of MTEB's own whose data can be reached (e.g. STSBenchmark).")
@click.option("--limit", type=click.IntRange(1), help="Local tasks: the first N validation "
              "sentences only (a quick run).")
@click.option("--token", help="A served URL's bearer token (default: --run's server's).")
@click.option("--run", "run_dir", type=click.Path(exists=True, file_okay=False),
              help="The run folder whose server answers URL (its token is used).")
@click.option("--threads", type=click.IntRange(1), help="An export folder's intra-op threads "
              "(default: every core).")
@click.option("--output", type=click.Path(dir_okay=False), help="Also write the scores here "
              "(JSON).")
def mteb(target: str, tasks: str, limit: int | None, token: str | None, run_dir: str | None,
         threads: int | None, output: str | None) -> None:
    """MTEB scores of an embedding model: TARGET is an embedding export folder (scored in
    its own runtime, as its server reads requests) or a served OpenAI embeddings URL
    (http://HOST:PORT/predictions/MODEL/1.0/v1): both give the same scores.

    \b
    The local tasks read SST-2 from COMPRESS_DATA_DIR: SST2LocalClassification (MTEB's
    classification protocol, accuracy) and SST2KnownItemRetrieval (a few words of a
    sentence find it among all validation sentences, nDCG@10).

    \b
    Examples:
      compress mteb runs/embed_int8/03-int8_aoti
      compress mteb http://127.0.0.1:8080/predictions/embed_int8/1.0/v1 --run runs/embed_int8
      compress mteb runs/embed_int8/01-int8_onnx --tasks SST2KnownItemRetrieval --limit 200
    """
    try:
        from compress.families.embedding import evaluation_harness as harness
    except ImportError as exc:
        raise UserError(f"MTEB is not installed ({exc}): {EVAL_EXTRA}") from None
    from compress.serving.serve_folder import token_of

    names = [name.strip() for name in tasks.split(",") if name.strip()]
    if not names:
        raise UserError("--tasks: name at least one MTEB task")
    if target.startswith(("http://", "https://")):
        embedder = harness.EndpointEmbedder(
            target, token or (token_of(run_dir) if run_dir else None))
    elif Path(target).is_dir():
        try:
            embedder = harness.ExportEmbedder(target, threads)
        except ValueError as exc:
            raise UserError(str(exc)) from None
    else:
        raise UserError(f"{target}: neither an export folder nor an http(s) URL")
    try:
        scores = harness.task_scores(embedder, names, limit)
    except (ValueError, OSError, RuntimeError) as exc:
        raise UserError(f"mteb: {exc}") from None
    width = max(len(name) for name in scores)
    for name, value in scores.items():
        click.echo(f"{name.removeprefix(harness.MTEB):<{width}}  {value:.4f}")
    if output:
        path = Path(output)
        partial = path.with_name(f".{path.name}.tmp")
        partial.write_text(json.dumps(scores, indent=2) + "\n")
        partial.replace(path)  # whole or not at all

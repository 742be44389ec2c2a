"""`compress serve` and `compress loadtest`: thin commands over compress.serving.server and
compress.serving.loadtest."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from compress.errors import CompressError, UserError

if TYPE_CHECKING:
    from compress.serving.ray.options import RayOptions


@click.command()
@click.argument("target", required=False, type=click.Path(exists=True))
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535),
              help="Inference port on 127.0.0.1.")
@click.option("--workers", type=click.IntRange(1, 64), help="Worker processes (default: "
              "the archive's).")
@click.option("--batch-size", type=click.IntRange(1, 1024),
              help="Largest batch TorchServe forms (default: the archive's).")
@click.option("--max-batch-delay", type=click.IntRange(0, 10_000), metavar="MS",
              help="Milliseconds TorchServe waits to fill a batch (default: the archive's).")
@click.option("--threads", type=click.IntRange(1, 4096), help="Intra-op threads of each "
              "worker (default: the archive's; workers x threads is capped at the cores).")
@click.option("--no-auth", is_flag=True, help="Turn TorchServe's token authorization off.")
@click.option("--enable-model-api", is_flag=True,
              help="Allow registering and scaling models through the management API "
              "(not with --no-auth).")
@click.option("--timeout", default=900, show_default=True, type=click.IntRange(1),
              help="Seconds to wait for a READY worker.")
@click.option("--stop", is_flag=True, help="Stop the server of TARGET (or every server "
              "compress started when TARGET is omitted).")
@click.option("--engine", type=click.Choice(["torchserve", "litserve", "ray"]),
              default="torchserve", show_default=True, help="The server: TorchServe (Java), "
              "LitServe running the archive's same handler (pip install litserve; no Java), "
              "or Ray Serve replicas of it on a Ray cluster (pip install 'ray[serve]').")
@click.option("--replicas", type=click.IntRange(1, 1024), help="Ray: replicas of the model "
              "(default 1).")
@click.option("--autoscale", metavar="MIN,MAX", help="Ray: between MIN and MAX replicas, "
              "scaled on the requests each holds (a full batch each).")
@click.option("--downscale-delay", type=click.FloatRange(0, 86_400), metavar="S",
              help="Ray, with --autoscale: seconds of lower load before a replica is "
              "removed (default Ray's 600).")
@click.option("--cpus-per-replica", type=click.FloatRange(0, 1024, min_open=True),
              help="Ray: CPUs each replica reserves (default: its threads).")
@click.option("--replica-resources", metavar="JSON", help="Ray: custom resources each "
              "replica asks for, e.g. '{\"replica_slot\": 1}' to place one a node.")
@click.option("--address", help="Ray: join the Ray cluster at this GCS address (HOST:PORT) "
              "instead of starting a local one.")
@click.option("--emit-kuberay", metavar="PATH", help="Ray: write a KubeRay RayService "
              "manifest (PATH.yaml) serving TARGET with these Ray options, and start nothing.")
@click.option("--kuberay-image", metavar="IMAGE", help="With --emit-kuberay: the pods' image, "
              "with compress installed (default: compress-pipeline:latest, a placeholder).")
def serve(target: str | None, port: int, workers: int | None, batch_size: int | None,
          max_batch_delay: int | None, threads: int | None, no_auth: bool,
          enable_model_api: bool, timeout: int, stop: bool, engine: str,
          replicas: int | None, autoscale: str | None, downscale_delay: float | None,
          cpus_per_replica: float | None, replica_resources: str | None,
          address: str | None, emit_kuberay: str | None, kuberay_image: str | None) -> None:
    """Serve TARGET (a run folder with a package stage, or a .mar) with TorchServe, with
    LitServe (--engine litserve: the same archive, handler, URLs and token), or with Ray
    Serve (--engine ray: the same, as replicas on a local or existing Ray cluster).

    \b
    Every listener binds 127.0.0.1; token authorization is on unless --no-auth. The
    server's files (config, logs, pid, tokens) live in <run>/serve/; the token is kept in
    files only its owner reads. Returns once a worker is READY and prints a curl command;
    stop it with --stop.

    \b
    Examples:
      compress serve runs/bert_int8
      compress serve runs/bert_int8 --port 8081 --batch-size 16 --max-batch-delay 10
      compress serve runs/bert_int8 --engine litserve
      compress serve runs/bert_int8 --engine ray --replicas 2
      compress serve runs/bert_int8 --engine ray --autoscale 1,4 --address 10.0.0.1:6379
      compress serve runs/bert_int8 --engine ray --replicas 2 --emit-kuberay bert.yaml
      compress serve runs/embed_search --threads 1 --batch-size 16
      compress serve --stop runs/bert_int8
    """
    from compress.serving import server
    from compress.serving.ray.options import RayOptions, parse_autoscale, parse_resources

    ray = RayOptions(replicas, parse_autoscale(autoscale), downscale_delay, cpus_per_replica,
                     parse_resources(replica_resources), address)
    if emit_kuberay is not None or kuberay_image is not None:
        _emit_kuberay(target, emit_kuberay, kuberay_image, ray, engine=engine,
                      auth=not no_auth, refused={
                          "--stop": stop, "--workers": workers, "--batch-size": batch_size,
                          "--max-batch-delay": max_batch_delay, "--threads": threads,
                          "--enable-model-api": enable_model_api})
        return
    if stop:
        stopped = server.stop_servers(target, echo=click.echo)
        click.echo(f"stopped {len(stopped)} server(s)" + "".join(f"\n  {s}" for s in stopped))
        return
    if target is None:
        raise click.UsageError("give a run folder or a .mar to serve (or --stop)")
    info = server.start(server.resolve_target(target), port=port, workers=workers,
                        batch_size=batch_size, max_batch_delay_ms=max_batch_delay,
                        threads=threads, auth=not no_auth, model_api=enable_model_api,
                        timeout_s=timeout,
                        echo=lambda m: click.echo(m, err=True), engine=engine, ray=ray)
    settings = info["settings"]
    shown = {"litserve": "LitServe", "ray": "Ray Serve"}.get(engine, "TorchServe")
    click.echo(f"serving {info['model_name']} at {info['url']} with {shown}")
    if engine == "ray":
        replicas_shown = (f"{ray.autoscale[0]} to {ray.autoscale[1]} replicas (autoscaled)"
                          if ray.autoscale else f"{ray.replicas or 1} replica(s)")
        where = (f"the Ray cluster at {info['ray_address']}" if ray.address else
                 f"a local Ray cluster ({info['ray_address']}), stopped with the server")
        click.echo(f"  {replicas_shown} on {where}")
    batching = (f"continuous batching over {settings['continuous_rows']} decode rows (each "
                f"request joins the running decode)" if settings.get("continuous_rows") else
                f"batch size {settings['batchSize']}, max batch delay "
                f"{settings['maxBatchDelay']} ms")
    unit = "replicas (at most)" if engine == "ray" else "workers"
    click.echo(f"  {unit} {settings['maxWorkers']} x {settings['threads_per_worker']} "
               f"threads, {batching}; logs in {info['serve_dir']}/logs")
    if info.get("token"):
        click.echo(f"  token: in {info['serve_dir']}/{server.SERVER_INFO} (mode 0600); "
                   f"read it with: {server.token_command(info)}")
    if info.get("metrics_url"):
        click.echo(f"  metrics (Prometheus): {info['metrics_url']}")
    click.echo(f"  try: {server.curl_example(info)}")
    click.echo(f"  stop: compress serve --stop {target}")


def _emit_kuberay(target: str | None, path: str | None, image: str | None, ray: RayOptions, *,
                  engine: str, auth: bool, refused: dict[str, object]) -> None:
    """`--emit-kuberay PATH`: the RayService manifest written, nothing started."""
    from pathlib import Path

    from compress.serving import server
    from compress.serving.ray import kuberay

    if path is None:
        raise UserError("--kuberay-image applies to --emit-kuberay PATH: give both")
    if engine != "ray":
        raise UserError("--emit-kuberay writes a Ray Serve manifest: add --engine ray")
    given = [flag for flag, value in refused.items() if value]
    if given:
        raise UserError(f"{', '.join(given)} with --emit-kuberay: the manifest serves the "
                        f"archive as packaged (its model-config.yaml), and starts nothing")
    if target is None:
        raise click.UsageError("give a run folder or a .mar to write the manifest for")
    resolved = server.resolve_target(target)
    manifest = kuberay.write_manifest(resolved, Path(path), ray, image=image, auth=auth)
    name = manifest["metadata"]["name"]
    click.echo(f"written: {path} (RayService {name}; nothing started)")
    click.echo("  read its header first (the image, the archive on a shared volume"
               + (", the token's Secret)" if auth else ")"))
    click.echo(f"  then: kubectl apply -f {path}")


@click.command()
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
@click.option("--task", type=click.Choice(["auto", "classification", "embedding",
                                           "reranking", "causal-lm"]),
              default="auto", show_default=True, help="What the endpoint serves (auto: the "
              "--run server's archive says, else classification). A reranker gets each text "
              "line as a query with the 8 lines after it as its documents.")
@click.option("--max-new-tokens", default=32, show_default=True,
              type=click.IntRange(1, 32_768), help="Causal LMs: tokens each request asks for.")
@click.option("--api", type=click.Choice(["auto", "native", "openai"]), default="auto",
              show_default=True, help="Causal LMs: compress's native stream (NDJSON), or "
              "OpenAI's streamed chat completions (auto: openai when URL ends in "
              "/v1/chat/completions; also llama.cpp's llama-server).")
@click.option("--shared-prefix", type=click.IntRange(1, 32_768), metavar="N",
              help="OpenAI API: every request starts with the same system prompt of about "
              "N tokens, then a distinct short question.")
@click.option("--ignore-eos", is_flag=True, help="OpenAI API: send \"ignore_eos\": true "
              "(llama-server's field; compress's continuous-batching archives take it too): "
              "every answer runs to --max-new-tokens.")
def loadtest(url: str, concurrency: str, n_requests: int, warmup: int, texts: str | None,
             token: str | None, run_dir: str | None, task: str, max_new_tokens: int,
             api: str, shared_prefix: int | None, ignore_eos: bool) -> None:
    """Load-test a served model at URL over loopback: throughput, latency percentiles,
    errors and the batch sizes TorchServe formed; for a causal LM, generated tokens/s and
    time to first token of the streamed answers (--texts: one prompt a line); through
    OpenAI's API (a URL ending in /v1/chat/completions), inter-token latency too.

    \b
    Examples:
      compress loadtest http://127.0.0.1:8080/predictions/bert_int8 --run runs/bert_int8
      compress loadtest http://127.0.0.1:8080/predictions/bert_int8 --concurrency 1,32 \\
          --requests 500 --token TOKEN
      compress loadtest http://127.0.0.1:8080/predictions/rerank_int8/1.0/v1/rerank \\
          --run runs/rerank_int8
      compress loadtest http://127.0.0.1:8080/predictions/llm_int8 --run runs/llm_int8 \\
          --concurrency 1,4,8 --requests 32 --max-new-tokens 64
      compress loadtest http://127.0.0.1:8080/predictions/llm_int8/v1/chat/completions \\
          --run runs/llm_int8 --concurrency 1,8 --requests 32 --shared-prefix 512
    """
    from compress.serving.loadtest.predictions import (
        format_table,
        load_payloads,
        rerank_payloads,
        sweep,
    )
    from compress.serving.loadtest.report import failure_summary, record_result
    from compress.serving.server import served_task, token_of

    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        raise UserError(f"--concurrency {concurrency!r}: expected numbers like 1,8,32") from None
    token = token or (token_of(run_dir) if run_dir else None)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if api == "auto":
        from compress.serving.loadtest.chat import is_chat_url

        api = "openai" if is_chat_url(url) else "native"
    if api == "native" and (shared_prefix or ignore_eos):
        raise UserError("--shared-prefix and --ignore-eos are for OpenAI's API: give a URL "
                        "ending in /v1/chat/completions (or --api openai)")
    if task == "auto":
        task = "causal-lm" if api == "openai" else (
            served_task(run_dir) if run_dir else "classification")
    if api == "openai":
        if task != "causal-lm":
            raise UserError("--api openai load-tests a causal LM's chat completions: leave "
                            "--task at auto or causal-lm")
        from compress.serving.loadtest.chat import format_chat_table, sweep_chat
        from compress.serving.loadtest.chat_workload import chat_payloads, read_prompts
        from compress.serving.loadtest.generation import SAMPLE_PROMPTS

        payloads = chat_payloads(read_prompts(texts, SAMPLE_PROMPTS), max_new_tokens,
                                 warmup + n_requests, shared_prefix,
                                 {"ignore_eos": True} if ignore_eos else None)
        result = sweep_chat(url, levels, n_requests, payloads, headers=headers, warmup=warmup)
        click.echo(format_chat_table(result))
    elif task == "causal-lm":
        from compress.serving.loadtest.generation import (
            format_generation_table,
            load_prompts,
            sweep_generation,
        )

        result = sweep_generation(url, levels, n_requests, load_prompts(texts, max_new_tokens),
                                  headers=headers, warmup=warmup)
        click.echo(format_generation_table(result))
    else:
        payloads = rerank_payloads(texts) if task == "reranking" else load_payloads(texts)
        result = sweep(url, levels, n_requests, payloads, headers=headers, warmup=warmup)
        click.echo(format_table(result))
    if run_dir:
        click.echo(f"written: {record_result(run_dir, result)}")
    summary = failure_summary(result, credentials=bool(token or run_dir))
    if summary:
        raise CompressError(summary)

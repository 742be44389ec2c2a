"""The served part of benchmarks/embedding/rerank.py: the run's reranker archive under
`compress serve` (`.../predictions/MODEL/VERSION/v1/rerank`) against infinity-emb 0.0.78's
`/v1/rerank` on the same model, both driven by the same client: one `httpx.AsyncClient`
posting Cohere's body (`{"model", "query", "documents"}`), a call a query with all its
documents, `concurrency` calls in flight.

The servers are benchmarks/embedding/served_servers.py's, probed with a rerank call:
compress's with `--engine torchserve|litserve`; infinity's (`infinity_emb v2 --engine
torch|optimum`) in its own environment (venvs.py's INFINITY) in the variants of served.py:
`torch` and `torch-compile` on the run's float model as a CrossEncoder folder, `optimum` and
`optimum-int8` on sentence-transformers' CrossEncoder ONNX export and its dynamic int8 file
for this CPU (those rerank.py times, built in the onnx environment). A round visits every
server in turn (reversed every other round), each started for its visit and stopped after
it. At each level: as many warm-up calls as the level, then `--requests` measured calls
cycling through the eval queries. Figures: pairs/s (documents scored over the level's wall
time), p50 / p99 latency, errors, resident memory of the server's tree, cold start, and the
served scores' fidelity to rerank.py's reference (from the first round's first level).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.embedding.items import BUILT, st_onnx_build
from benchmarks.embedding.served_load import level_figures
from benchmarks.embedding.served_servers import INFINITY_VARIANTS, Server, infinity_folder
from benchmarks.embedding.venvs import INFINITY
from benchmarks.harness import servers
from benchmarks.harness.cli import echo, numbers
from benchmarks.harness.rounds import alternating
from benchmarks.harness.spread import aligned
from benchmarks.harness.venv import PeerError, ensure_venv

ENGINES = ("torchserve", "litserve")
FIGURES = ("pairs_per_s", "latency_ms_p50", "latency_ms_p99")
COLUMNS = (("server", "name"), ("conc", "concurrency"), ("pairs/s", "pairs_per_s"),
           ("p50 ms", "latency_ms_p50"), ("p99 ms", "latency_ms_p99"), ("errors", "errors"),
           ("max abs Δscore", "score_max_abs_diff"), ("Kendall τ", "kendall_tau"),
           ("rounds", "rounds"), ("RSS MB", "rss_mb"), ("cold start s", "cold_start_s"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The served part's options."""
    parser.add_argument("--no-served", action="store_true",
                        help="leave out the served part (compress serve against infinity)")
    parser.add_argument("--engine", default="torchserve", choices=ENGINES,
                        help="compress's server (torchserve)")
    parser.add_argument("--infinity", default=",".join(INFINITY_VARIANTS),
                        help=f"infinity's variants ({','.join(INFINITY_VARIANTS)}); '' for none")
    parser.add_argument("--no-compress-server", action="store_true",
                        help="infinity alone (a run without a package stage)")
    parser.add_argument("--concurrency", default="1,8", help="levels, comma-separated (1,8)")
    parser.add_argument("--requests", type=int, default=64,
                        help="measured calls a level, a query with its documents each (64)")
    parser.add_argument("--start-timeout", type=int, default=600,
                        help="seconds a server may take to answer its first call (600)")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """What is wrong with the served options (each one line); sets `levels`, `variants`."""
    args.levels = numbers(parser, "--concurrency", args.concurrency, "1,8")
    args.variants = [v for v in args.infinity.split(",") if v]
    problems = [f"unknown infinity variant {v!r} (known: {', '.join(INFINITY_VARIANTS)})"
                for v in args.variants if v not in INFINITY_VARIANTS]
    problems += [f"--{n.replace('_', '-')} must be at least 1" for n in (
        "requests", "start_timeout") if getattr(args, n) < 1]
    problems += ["--concurrency: give levels of at least 1"] if not args.levels or min(
        args.levels) < 1 else []
    if not args.no_served and args.no_compress_server and not args.variants:
        problems.append("no server to measure")
    return problems


def plan(args: argparse.Namespace, run_dir: Path) -> dict[str, Any] | None:
    """The compress server's facts (None with --no-served); a UserError for a run whose
    archive is not a reranker's, or that has none, before anything is timed."""
    if args.no_served:
        return None
    if args.no_compress_server:
        return {}
    import json
    import zipfile

    import yaml

    from compress.errors import UserError
    from compress.serving.serve_target import resolve_target

    target = resolve_target(run_dir)
    with zipfile.ZipFile(target.mar) as archive:
        manifest = json.loads(archive.read("MAR-INF/MANIFEST.json"))
        config = (yaml.safe_load(archive.read("model-config.yaml"))
                  if "model-config.yaml" in archive.namelist() else None) or {}
    task = (config.get("handler") or {}).get("task")
    if task != "reranking":
        raise UserError(f"{target.mar}: not a reranker archive (handler task {task!r}); "
                        "give --no-compress-server to measure infinity alone")
    served = archive_export(run_dir, target.mar)
    return {"key": f"compress-{args.engine}",
            "name": f"compress {args.engine}" + (f" ({served})" if served else ""),
            "kind": "compress", "engine": args.engine, "target": str(run_dir),
            "serve_dir": str(target.serve_dir), "model_name": target.model_name,
            "version": str(manifest["model"].get("modelVersion") or "1.0"),
            "batch_size": config.get("batchSize"), "rounds": []}


def archive_export(run_dir: Path, mar: Path) -> str | None:
    """The name of the export the run packaged into `mar` (its package stage's
    `artifact`), where the manifest says."""
    from compress.runfolder.records import require_manifest

    for stage in require_manifest(run_dir).stages:
        if stage.outputs and stage.outputs[0].path and (
                (run_dir / stage.outputs[0].path).resolve() == mar.resolve()):
            return (stage.config or {}).get("artifact")
    return None


class RerankServer(Server):
    """served_servers' Server, ready once it answers a rerank call."""

    def ready(self) -> str | None:
        return probe(self.base_url, self.model)


def server_items(compress: dict[str, Any], args: argparse.Namespace, run_dir: Path,
                 model: Path, versions: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """The servers: compress's (when planned) and infinity's variants (each ready, or
    carrying why not); the infinity environment's versions go to `versions`."""
    items = [compress] if compress else []
    if not args.variants:
        return items
    binary = str(INFINITY.path() / "bin" / "infinity_emb")
    try:
        versions[INFINITY.name] = ensure_venv(INFINITY, echo)
        ready: Any = True
    except PeerError as exc:
        ready = f"{INFINITY.name} environment: {exc}"
    built = st_onnx_build(run_dir, model, echo, cross_encoder=True) if ready is True and any(
        v.startswith("optimum") for v in args.variants) else ready
    for variant in args.variants:
        item = {"key": f"infinity-{variant}", "name": f"infinity {variant}", "kind": "infinity",
                "variant": variant, "folder": str(model), "binary": binary, "rounds": []}
        if ready is not True:
            item["error"] = str(ready)
        elif variant.startswith("optimum") and isinstance(built, dict):
            key = "int8" if variant.endswith("int8") else "fp32"
            item["folder"] = str(infinity_folder(Path(built["folder"]), built["files"][key],
                                                 run_dir / BUILT / f"infinity_ce_{key}"))
        elif variant.startswith("optimum"):
            item["error"] = f"no ONNX files: {built}"
        items.append(item)
    return items


def run(compress: dict[str, Any] | None, args: argparse.Namespace, run_dir: Path,
        model: Path | None, examples: Any, work: Path,
        fidelity: Callable[[Any], dict[str, Any]], versions: dict[str, dict[str, str]]
        ) -> list[dict[str, Any]]:
    """The served rounds (none when `compress` is None: --no-served); the items, each with
    its rounds' figures and its scores' fidelity (infinity's versions go to `versions`)."""
    if compress is None or model is None:
        return []
    queries = by_query(examples.texts, examples.pairs)
    items = server_items(compress, args, run_dir, model, versions)
    for r, item in alternating(items, args.rounds):
        if item.get("error"):
            continue
        echo(f"peers_rerank: served round {r + 1}/{args.rounds}: {item['name']}: starting")
        scores: dict[int, list[float]] = {}

        def load(server: Server, figures: dict[str, Any], keep: dict = scores) -> None:
            figures["runs"] = run_levels(server.base_url, server.model, queries, args.levels,
                                         args.requests, keep)

        figures = servers.visit(RerankServer(item, work), args.start_timeout, load)
        item["rounds"].append(figures)
        if r == 0 and len(scores) == len(queries):
            item["quality"] = fidelity([s for k in range(len(queries)) for s in scores[k]])
        echo(f"peers_rerank: served round {r + 1}/{args.rounds}: {item['name']}: " + (
            f"failed: {figures['error']}" if "error" in figures else
            f"cold start {figures['cold_start_s']:.1f} s, " + ", ".join(
                f"c{level['concurrency']} {level['pairs_per_s']} pairs/s"
                + (f" ({level['errors']} errors)" if level["errors"] else "")
                for level in figures["runs"])))
    return items


def by_query(texts: list[str], documents: list[str]) -> list[tuple[str, list[str]]]:
    """Consecutive pairs of one query as (query, its documents), in order."""
    grouped: list[tuple[str, list[str]]] = []
    for query, document in zip(texts, documents, strict=True):
        if not grouped or grouped[-1][0] != query:
            grouped.append((query, []))
        grouped[-1][1].append(document)
    return grouped


async def _rerank(client: Any, url: str, model: str, query: str, documents: list[str]
                  ) -> list[float]:
    """One rerank call: each document's score, in the order sent."""
    answer = await client.post(url, json={"model": model, "query": query,
                                          "documents": documents, "return_documents": False})
    answer.raise_for_status()
    results = answer.json()["results"]
    scores = [float("nan")] * len(documents)
    for result in results:
        scores[result["index"]] = float(result["relevance_score"])
    if len(results) != len(documents):
        raise ValueError(f"{len(results)} scores for {len(documents)} documents")
    return scores


async def _drive(client: Any, url: str, model: str, queries: list[tuple[str, list[str]]],
                 calls: list[int], concurrency: int, keep: dict[int, list[float]]
                 ) -> tuple[list[float], int, list[str], float]:
    """Make `calls` (query indexes) with `concurrency` in flight; (latencies, pairs scored,
    errors, wall). Each query's first scores go to `keep`."""
    latencies: list[float] = []
    errors: list[str] = []
    scored = 0
    pending = iter(calls)

    async def worker() -> None:
        nonlocal scored
        for k in pending:
            began = time.perf_counter()
            try:
                scores = await _rerank(client, url, model, *queries[k])
            except Exception as exc:  # noqa: BLE001 - counted; the level goes on
                errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")
                continue
            latencies.append(1000 * (time.perf_counter() - began))
            scored += len(scores)
            keep.setdefault(k, scores)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(calls)))))
    return latencies, scored, errors, time.perf_counter() - began


async def _levels(base_url: str, model: str, queries: list[tuple[str, list[str]]],
                  levels: list[int], requests: int, keep: dict[int, list[float]],
                  timeout: float) -> list[dict[str, Any]]:
    import httpx

    url, out, start = f"{base_url}/rerank", [], 0
    limits = httpx.Limits(max_connections=max(levels))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        for level in levels:
            warm = [(start + i) % len(queries) for i in range(level)]
            await _drive(client, url, model, queries, warm, level, {})
            calls = [(start + level + i) % len(queries) for i in range(requests)]
            start += level + requests
            latencies, scored, errors, wall = await _drive(client, url, model, queries,
                                                           calls, level, keep)
            figures = level_figures(latencies, scored, errors, level, requests, wall)
            figures["pairs_per_s"] = figures.pop("embeddings_per_s")
            out.append(figures)
    return out


def run_levels(base_url: str, model: str, queries: list[tuple[str, list[str]]],
               levels: list[int], requests: int, keep: dict[int, list[float]],
               timeout: float = 300.0) -> list[dict[str, Any]]:
    """Each level's figures, in order: `level` warm-up calls, then `requests` measured;
    the scores of each query first answered in a measured call go to `keep`."""
    return asyncio.run(_levels(base_url, model, queries, levels, requests, keep, timeout))


def probe(base_url: str, model: str, timeout: float = 60.0) -> str | None:
    """None when one rerank call is answered, else why not (one line)."""
    import httpx

    try:
        answer = httpx.post(f"{base_url}/rerank", timeout=timeout, json={
            "model": model, "query": "ready?", "documents": ["yes"]})
        answer.raise_for_status()
        answer.json()["results"]
        return None
    except Exception as exc:  # noqa: BLE001 - the caller retries until its deadline
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def table(items: list[dict[str, Any]], args: argparse.Namespace
          ) -> tuple[list[dict[str, Any]], list[str]]:
    """(one row per server and level, with its scores' fidelity; the ratio and failure
    lines)."""
    levels = getattr(args, "levels", [])
    rows = servers.level_rows(items, levels, FIGURES)
    quality = {item["key"]: item.get("quality") or {} for item in items}
    for row in rows:
        for key in ("score_max_abs_diff", "kendall_tau"):
            value = quality[row["key"]].get(key)
            row[key] = None if value is None else round(value, 5)
    lines = servers.rate_ratios(rows, levels, "pairs_per_s", "pairs/s")
    lines += [f"{i['name']}: failed: {i['error']}" for i in items if i.get("error")]
    lines += [f"{i['name']}: round {r + 1} failed: {f['error']}"
              for i in items for r, f in enumerate(i.get("rounds") or []) if f.get("error")]
    return rows, lines


def render_text(rows: list[dict[str, Any]], lines: list[str]) -> str:
    """The served table as aligned text, then the ratio and failure lines."""
    out = aligned([[t for t, _ in COLUMNS], *servers.cells(rows, COLUMNS)], 1)
    return "\n".join(out + [""] + lines) + "\n"


def render_markdown(rows: list[dict[str, Any]], lines: list[str], header: dict[str, Any]
                    ) -> str:
    """The served table as Markdown, its title one level down from rerank.py's."""
    facts = {"load": "a call a query with all its documents (Cohere's body, the same "
                     "httpx client for every server), as many warm-up calls as the level "
                     "first", "fidelity": f"against {header.get('reference', '?')}"}
    served = {"title": "Served: compress serve `/v1/rerank` against infinity-emb `/rerank`",
              "section": True, "facts": facts,  # the file's header is rerank.py's
              "notes": ["Each server is started for its visit in a round and stopped after "
                        "it, so it runs alone; cold start is from its launch to its first "
                        "answered call, the median of the starts.",
                        "pairs/s: documents scored over the level's wall time; p50 / p99 from "
                        "a call to its parsed answer; medians over rounds, errors summed, RSS "
                        "the largest of the server's process tree; fidelity from the first "
                        "round's answers.",
                        "infinity-emb 0.0.78's optimum engine tokenizes a pair with "
                        "`return_token_type_ids=False` (OptimumCrossEncoder.encode_pre), so a "
                        "BERT cross-encoder reads the document as the query's segment: its "
                        "scores differ from predict's even from the fp32 file; its torch "
                        "engine passes them."]}
    return "#" + servers.markdown(rows, COLUMNS, 1, lines, served)

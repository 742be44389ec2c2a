"""Served embeddings: `compress serve` of a run's embedding archive against infinity-emb on
the same model, both driven by the same OpenAI client (`embeddings.create`), in one
invocation. From the repository root:

    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.embedding.served runs/embed_int8
    python -m benchmarks.embedding.served RUN --quick            # 1 round, c1 and c8
    python -m benchmarks.embedding.served RUN --no-compress      # infinity's variants alone
    python -m benchmarks.embedding.served RUN --no-sweep         # the archive's settings

infinity-emb 0.0.78 lives in its own environment (venvs.py) and runs four variants
(served_servers.py): torch, torch with --compile, ONNX Runtime on sentence-transformers'
fp32 ONNX and on its dynamic int8 file for this CPU (both built by peers.py's onnx
environment). First the sweep (served_sweep.py, off with --no-sweep): every server at every
batch size of --sweep-batches and thread count of --sweep-threads, loaded at the highest
--concurrency with --sweep-requests calls, each then measured at its fastest setting with no
failed call. A round visits every server in turn (reversed every other round); each is
started for its visit and stopped after it, so it runs alone. At each concurrency: as many
warm-up calls as the level, then `--requests` measured calls of `--inputs` eval texts each
(served_load.py). Prints the table (served_table.py) and writes Markdown and JSON. Exit 2:
bad arguments, a run that is missing, unfinished or not packaged (give --no-compress for
infinity alone); 1: a server or a build failed (the others are still reported).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

from benchmarks.embedding.items import BUILT, st_onnx_build
from benchmarks.embedding.peers import eval_texts, source_model
from benchmarks.embedding.served_load import run_levels
from benchmarks.embedding.served_servers import INFINITY_VARIANTS, Server, infinity_folder
from benchmarks.embedding.served_sweep import (
    default_threads,
    grid,
    run_sweep,
    sweep_markdown,
    sweep_rows,
    sweep_text,
)
from benchmarks.embedding.served_table import ratios, render_markdown, render_text, table_rows
from benchmarks.embedding.venvs import INFINITY
from benchmarks.harness import servers
from benchmarks.harness.cli import Parser, echo, exit_code, fill, numbers
from benchmarks.harness.paths import RESULTS, default_data_dir
from benchmarks.harness.provenance import results_header, scrubbed, shown
from benchmarks.harness.rounds import alternating
from benchmarks.harness.runs import check_finished
from benchmarks.harness.venv import ensure_venv
from compress.errors import UserError
from compress.runfolder.files import atomic_write_json, atomic_write_text
from compress.serving.serve_target import resolve_target

ENGINES = ("torchserve", "litserve")
MODULE = "benchmarks.embedding.served"
FULL = {"rounds": 2, "concurrency": "1,8,32", "requests": 256, "sweep_requests": 96}
QUICK = {"rounds": 1, "concurrency": "1,8", "requests": 32, "sweep_requests": 16}
SWEEP_BATCHES = "8,16,32"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help="a finished run of an embedding recipe with a package stage")
    parser.add_argument("--quick", action="store_true", help="a development run: "
                        + ", ".join(f"--{k} {v}" for k, v in QUICK.items()))
    parser.add_argument("--rounds", type=int, help=f"alternating rounds ({FULL['rounds']})")
    parser.add_argument("--concurrency", help=f"levels, comma-separated ({FULL['concurrency']})")
    parser.add_argument("--requests", type=int, help=f"measured calls a level ({FULL['requests']})")
    parser.add_argument("--inputs", type=int, default=1, help="texts a call (1)")
    parser.add_argument("--engines", default="torchserve",
                        help=f"compress's engines, of {','.join(ENGINES)} (torchserve)")
    parser.add_argument("--infinity", default=",".join(INFINITY_VARIANTS),
                        help=f"infinity's variants ({','.join(INFINITY_VARIANTS)}); '' for none")
    parser.add_argument("--no-compress", action="store_true", help="infinity alone")
    parser.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                        help="choose each server's batch size and threads by the same sweep "
                        "first (default); --no-sweep: compress's archive settings and "
                        "infinity's --batch with every core")
    parser.add_argument("--sweep-batches", default=SWEEP_BATCHES,
                        help=f"the sweep's batch sizes ({SWEEP_BATCHES})")
    parser.add_argument("--sweep-threads", default=",".join(map(str, default_threads())),
                        help="the sweep's thread counts (this machine: "
                        f"{','.join(map(str, default_threads()))})")
    parser.add_argument("--sweep-requests", type=int, help="calls a setting, at the highest "
                        f"--concurrency ({FULL['sweep_requests']})")
    parser.add_argument("--batch", help="with --no-sweep: infinity's --batch-size, "
                        "comma-separated for a server each (32; 16,32: the faster counts)")
    parser.add_argument("--start-timeout", type=int, default=600,
                        help="seconds a server may take to answer its first call (600)")
    parser.add_argument("--markdown", type=Path, metavar="PATH",
                        default=RESULTS / "serve_peers_embed.md",
                        help="default: benchmarks/results/serve_peers_embed.md")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="every figure (default: the Markdown path with .json)")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the header's command
    fill(args, QUICK if args.quick else FULL)
    args.levels = numbers(parser, "--concurrency", args.concurrency, "1,8,32")
    args.batches = numbers(parser, "--batch", args.batch or "32", "16,32")
    args.sweep_grid = grid(numbers(parser, "--sweep-batches", args.sweep_batches, "8,16,32"),
                           numbers(parser, "--sweep-threads", args.sweep_threads, "1,2"))
    args.engines = [] if args.no_compress else [e for e in args.engines.split(",") if e]
    args.variants = [v for v in args.infinity.split(",") if v]
    problems = [f"unknown engine {e!r} (known: {', '.join(ENGINES)})"
                for e in args.engines if e not in ENGINES]
    problems += [f"unknown infinity variant {v!r} (known: {', '.join(INFINITY_VARIANTS)})"
                 for v in args.variants if v not in INFINITY_VARIANTS]
    problems += [f"--{n.replace('_', '-')} must be at least 1" for n in (
        "rounds", "requests", "inputs", "start_timeout", "sweep_requests")
        if getattr(args, n) < 1]
    problems += ["--batch is for --no-sweep (the sweep chooses the batch: --sweep-batches)"
                 ] if args.sweep and args.batch else []
    problems += ["--sweep-batches, --sweep-threads: give numbers of at least 1"] if args.sweep \
        and (not args.sweep_grid or min(min(s.values()) for s in args.sweep_grid) < 1) else []
    problems += ["--batch: give sizes of at least 1"] if not args.batches or min(
        args.batches) < 1 else []
    problems += ["--concurrency: give levels of at least 1"] if not args.levels or min(
        args.levels) < 1 else []
    problems += ["no server to measure"] if not args.engines and not args.variants else []
    if problems:
        parser.error("; ".join(problems))
    return args


def archive_facts(mar: Path) -> dict[str, Any]:
    """Model name, version and batching of an embedding archive; PeerError for another."""
    with zipfile.ZipFile(mar) as archive:
        manifest = json.loads(archive.read("MAR-INF/MANIFEST.json"))
        names = archive.namelist()
        config = yaml.safe_load(archive.read("model-config.yaml")) \
            if "model-config.yaml" in names else {}
    handler = (config or {}).get("handler") or {}
    if handler.get("task") != "embedding":
        raise UserError(f"{mar}: not an embedding archive (handler task "
                        f"{handler.get('task')!r})")
    return {"model_name": manifest["model"]["modelName"],
            "version": str(manifest["model"].get("modelVersion") or "1.0"),
            "batch_size": config.get("batchSize"), "max_batch_delay": config.get("maxBatchDelay"),
            "workers": config.get("minWorkers"), "threads": handler.get("threads")}


def server_items(args: argparse.Namespace, run_dir: Path, source: Path
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The servers (each ready, or carrying why not) and the facts for the header."""
    items, facts = [], {}
    if args.engines:
        target = resolve_target(run_dir)
        facts["compress archive"] = archive_facts(target.mar)
        for engine in args.engines:
            items.append({"key": f"compress-{engine}", "name": f"compress {engine}",
                          "kind": "compress", "engine": engine, "target": str(run_dir),
                          "serve_dir": str(target.serve_dir), **facts["compress archive"],
                          "batch": facts["compress archive"]["batch_size"],
                          "threads": facts["compress archive"]["threads"], "rounds": []})
    if args.variants:
        infinity = ensure_venv(INFINITY, echo)
        facts["infinity environment"] = infinity
        built = st_onnx_build(run_dir, source, echo) if any(
            v.startswith("optimum") for v in args.variants) else None
        batches = [None] if args.sweep else args.batches  # the sweep sets each one's
        named = len(batches) > 1  # the batch in the name only when it varies
        for variant, batch in ((v, b) for v in args.variants for b in batches):
            suffix = f" b{batch}" if named else ""
            item = {"key": f"infinity-{variant}{suffix.replace(' ', '-')}",
                    "name": f"infinity {variant}{suffix}", "batch": batch, "threads": None,
                    "kind": "infinity", "variant": variant, "folder": str(source),
                    "binary": str(INFINITY.path() / "bin" / "infinity_emb"), "rounds": []}
            if variant.startswith("optimum") and isinstance(built, dict):
                key = "int8" if variant.endswith("int8") else "fp32"
                item["folder"] = str(infinity_folder(Path(built["folder"]), built["files"][key],
                                                     run_dir / BUILT / f"infinity_{key}"))
            elif variant.startswith("optimum"):
                item["error"] = f"no ONNX files: {built}"
            items.append(item)
    return items, facts


def visit(item: dict[str, Any], args: argparse.Namespace, texts: list[str], work: Path,
          setting: dict[str, Any] | None = None, levels: list[int] | None = None,
          requests: int | None = None) -> dict[str, Any]:
    """One visit's figures of one server at `setting` (default: the item's batch and
    threads): started, loaded at every level, stopped; an ONNX variant's
    "onnx_optimization" (what infinity made of its optimization) also on the item."""
    setting = setting or item

    def load(server: Server, figures: dict[str, Any]) -> None:
        figures["runs"] = run_levels(server.base_url, server.model, texts,
                                     levels or args.levels, requests or args.requests,
                                     args.inputs)

    server = Server(item, work, setting.get("batch"), setting.get("threads"))
    figures = servers.visit(server, args.start_timeout, load)
    if server.optimization:
        figures["onnx_optimization"] = item["onnx_optimization"] = server.optimization
    return figures


def sweep(items: list[dict[str, Any]], args: argparse.Namespace, texts: list[str],
          work: Path) -> None:
    """Each server at every setting of the grid, at the highest level; each item's choice."""
    top = max(args.levels)

    def trial(item: dict[str, Any], setting: dict[str, int]) -> dict[str, Any]:
        figures = visit(item, args, texts, work, setting, [top], args.sweep_requests)
        run = (figures.get("runs") or [{}])[0]
        return {k: v for k, v in {**figures, **run}.items() if k != "runs"}

    run_sweep(items, args.sweep_grid, trial, echo)


def sweep_how(args: argparse.Namespace) -> str:
    """The sweep's load and rule, in a sentence."""
    top = max(args.levels)
    batches = sorted({s["batch"] for s in args.sweep_grid})
    threads = sorted({s["threads"] for s in args.sweep_grid})
    return (f"Every server at batch sizes {','.join(map(str, batches))} x threads "
            f"{','.join(map(str, threads))} (compress: `compress serve --batch-size B "
            f"--threads T`; infinity: `--batch-size B` and OMP_NUM_THREADS=T), each started "
            f"alone and loaded at c{top}: {top} warm-up calls, then {args.sweep_requests} "
            f"calls of {args.inputs} text(s). Chosen: the most emb/s among the settings "
            f"with no failed call (a tie: fewer threads, then the smaller batch); the table "
            f"above measures each server at its chosen setting.")


def measure(items: list[dict[str, Any]], args: argparse.Namespace, texts: list[str],
            work: Path) -> None:
    """The rounds, alternating the order; each round's figures appended to its item."""
    for r, item in alternating(items, args.rounds):
        if item.get("error"):
            continue
        echo(f"serve_peers_embed: round {r + 1}/{args.rounds}: {item['name']}: starting")
        figures = visit(item, args, texts, work)
        item["rounds"].append(figures)
        echo(f"serve_peers_embed: round {r + 1}/{args.rounds}: {item['name']}: " + (
            f"failed: {figures['error']}" if "error" in figures else
            f"cold start {figures['cold_start_s']:.1f} s, " + ", ".join(
                f"c{run['concurrency']} {run['embeddings_per_s']} emb/s"
                + (f" ({run['errors']} errors)" if run["errors"] else "")
                for run in figures["runs"])))


def optimization_facts(items: list[dict[str, Any]]) -> dict[str, str]:
    """The header's line on infinity's own ONNX optimization: each ONNX variant's outcome
    (its last start's: optimized and its file, or infinity's reason it was not)."""
    seen = {i["name"]: i["onnx_optimization"] for i in items if i.get("onnx_optimization")}
    return {"infinity's ONNX optimization": "; ".join(f"{k}: {v}" for k, v in seen.items())
            } if seen else {}


def main(argv: list[str] | None = None) -> int:
    """Measure and report; 0, 1 when a server or a build failed, 2 for bad input."""
    default_data_dir()  # the SST-2 mirror beside the repository, unless one is named
    return exit_code(lambda: _main(parse_args(argv)))


def _main(args: argparse.Namespace) -> int:
    run_dir = args.run_dir.resolve()
    check_finished(run_dir)
    texts, recipe, _ = eval_texts(run_dir, None)
    source, _ = source_model(recipe)
    items, facts = server_items(args, run_dir, source)
    work = Path(tempfile.mkdtemp(prefix="serve_peers_embed-"))
    echo(f"serve_peers_embed: server logs in {work}")
    if args.sweep:
        sweep(items, args, texts, work)
    measure(items, args, texts, work)
    rows = table_rows(items, args.levels)
    lines = ratios(rows, args.levels) + [f"{i['name']}: failed: {i['error']}" for i in items
                                         if i.get("error")] + [
        f"{i['name']}: round {r + 1} failed: {f['error']}"
        for i in items for r, f in enumerate(i["rounds"]) if f.get("error")]
    swept = sweep_rows(items)
    print(render_text(rows, lines) + sweep_text(swept), end="")
    peers = {"infinity's environment": facts["infinity environment"]} if isinstance(
        facts.get("infinity environment"), dict) else None
    header = {**results_header(MODULE, args.argv, peers=peers),
              "title": "Served embeddings: compress serve against infinity-emb",
              "facts": {"model": f"{recipe.model.source} ({shown(source)})",
                        "load": f"{args.requests} calls a level after as many warm-up calls "
                                f"as the level, {args.inputs} eval text(s) a call "
                                f"({len(texts)} texts, cycled), {args.rounds} round(s)",
                        **{k: json.dumps(v) for k, v in facts.items()},
                        **({"settings": "chosen by the sweep below"} if args.sweep else {
                            "settings": "no sweep: compress's archive settings, infinity's "
                                        "--batch with its threads unset (every core)"}),
                        **optimization_facts(items)},
              "notes": ["Each server is started for its visit in a round and stopped after "
                        "it, so it runs alone; cold start is from launching its command to "
                        "its first answered call, median of the starts.",
                        "emb/s: embeddings returned over the level's wall time; p50 / p99: "
                        "from a call to its parsed answer. Figures are medians over rounds; "
                        "errors a sum; RSS the largest of the server's process tree."]}
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.markdown, scrubbed(render_markdown(rows, lines, header)
                                              + sweep_markdown(swept, sweep_how(args))))
    json_path = args.json or args.markdown.with_suffix(".json")
    atomic_write_json(json_path, scrubbed({
        "header": header, "items": items, "rows": rows, "ratios": lines,
        "sweep": {"how": sweep_how(args), "grid": args.sweep_grid, "rows": swept,
                  "chosen": {i["name"]: (i.get("sweep") or {}).get("chosen") for i in items}}
        if args.sweep else None}))
    echo(f"serve_peers_embed: wrote {args.markdown} and {json_path}")
    failed = [i for i in items if i.get("error") or any(r.get("error") for r in i["rounds"])]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

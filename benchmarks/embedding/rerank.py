"""A reranker run's exports against sentence-transformers' CrossEncoder and infinity-emb.

The run's exports next to what a user would run instead on the same model, all timed in one
invocation on this machine. From the repository root:

    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.embedding.rerank runs/rerank_int8
    python -m benchmarks.embedding.rerank RUN --rounds 1 --limit 20 --passes 1 --requests 16
    python -m benchmarks.embedding.rerank RUN --no-peers --no-served   # compress's alone

Rows: sentence-transformers' `CrossEncoder.predict` in fp32 on torch (the reference), on its
ONNX backend's export and on that export's dynamic int8 for this CPU
(`export_dynamic_quantized_onnx_model`, avx512_vnni or avx2), in the peers' onnx environment
(venvs.py), and every export of the run whose export.json has a `reranker` block. The peers
get the run's float model itself: a bare encoder's seeded head is the run's, written once as
a CrossEncoder folder in `<run>/peers/rerank/model/`. Each row is timed in a fresh process
per round (child.py's "rerank" mode), rounds alternating order: the eval pairs in order, in
batches padded to their longest, pairs in and scores out. Fidelity is against the reference
row's scores (largest difference, Kendall's tau per query with the family's tie margin).
Then, unless --no-served, the run's archive served at `/v1/rerank` against infinity-emb's
`/rerank` (rerank_served.py). Prints the tables (rerank_table.py), writes Markdown and JSON.
Exit 2: bad arguments, a missing or unfinished run, not a reranker run; 1: a row, a build or
a server failed (the others are still reported).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.embedding import rerank_served
from benchmarks.embedding.items import CHILD, st_onnx_build
from benchmarks.embedding.rerank_table import render_markdown, render_text, table_rows
from benchmarks.embedding.table import select
from benchmarks.embedding.venvs import ONNX
from benchmarks.harness.cli import Parser, echo, exit_code
from benchmarks.harness.paths import RESULTS, default_data_dir
from benchmarks.harness.provenance import results_header, scrubbed, shown
from benchmarks.harness.rounds import alternating, record, run_module
from benchmarks.harness.runs import check_finished, eval_recipe
from benchmarks.harness.venv import PeerError, ensure_venv
from compress.errors import UserError
from compress.runfolder.files import atomic_write_json, atomic_write_text, run_lock

DEFAULT_MARKDOWN = RESULTS / "peers_rerank.md"
MODULE = "benchmarks.embedding.rerank"
PEERS = ("st_fp32", "st_onnx", "st_onnx_int8")
REFERENCE = "st_fp32"  # fidelity is against this row's scores
FIXED = (8, 128)  # the like-for-like shape: pairs, tokens a pair
MODEL = "peers/rerank/model"  # under the run: its float model as a CrossEncoder folder
TASK = "reranking"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help="a finished run of a reranker recipe (recipes/rerank_int8.yaml)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating order (3)")
    parser.add_argument("--limit", type=int, metavar="N", help="the first N eval queries (all)")
    parser.add_argument("--passes", type=int, default=3,
                        help="timed passes over the pairs per process; a round is their "
                             "median (3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches first (3)")
    parser.add_argument("--batch", type=int, default=32, help="pairs per batch (32)")
    parser.add_argument("--rows", nargs="+", metavar="NAME", help="time only these rows "
                        f"(peers: {', '.join(PEERS)}; compress's: its export names); "
                        f"{REFERENCE} is always timed with the peers")
    parser.add_argument("--no-peers", action="store_true", help="compress's exports alone "
                        "(no environment; fidelity against the run's own reference scores)")
    rerank_served.add_arguments(parser)
    parser.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN, metavar="PATH",
                        help="the tables as Markdown (benchmarks/results/peers_rerank.md)")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="every figure (default RUN_DIR/peers_rerank.json)")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the header's command
    problems = [f"--{name} must be at least 1" for name in ("rounds", "limit", "passes", "batch")
                if getattr(args, name) is not None and getattr(args, name) < 1]
    problems += ["--warmup must be at least 0"] if args.warmup < 0 else []
    problems += rerank_served.check_arguments(parser, args)
    if problems:
        parser.error("; ".join(problems))
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure and report; 0, 1 when anything failed, 2 for a user error."""
    default_data_dir()  # the SST-2 mirror beside the repository, unless one is named
    return exit_code(lambda: _main(parse_args(argv)))


def eval_pairs(run_dir: Path, limit: int | None) -> tuple[Any, Any]:
    """(the run's eval pairs, the first `limit` queries': an `Examples` of query texts,
    document pairs and labels; its recipe)."""
    from compress.families.reranker.pairs import groups_of, load_pairs
    from compress.recipe.datasets import resolve_data

    recipe = eval_recipe(run_dir)
    examples = load_pairs(recipe, resolve_data(recipe.data.source)).splits["eval"]
    if limit:
        groups = groups_of(examples)
        examples = examples.subset([i for i, g in enumerate(groups) if g < limit])
    return examples, recipe


def float_model(run_dir: Path, recipe: Any) -> Path:
    """The run's float cross-encoder as sentence-transformers saves one (the recipe's model
    as the run loaded it: a bare encoder's new head seeded by the recipe's seed), written
    once in `<run>/peers/rerank/model/` and kept while the source and seed are the same."""
    from compress.families.reranker.family import load_model
    from compress.families.reranker.folder import save_cross_encoder
    from compress.recipe.sources import resolve_model
    from compress.runfolder.files import sha256_file

    source = resolve_model(recipe.model.source, recipe.model.checkpoint)
    weights = sorted(Path(source.location).glob("*.safetensors"))
    said = {"source": str(source.location), "seed": recipe.seed,
            "checkpoint": recipe.model.checkpoint,
            "sha256": [sha256_file(p) for p in weights]}
    folder = run_dir / MODEL
    try:
        if json.loads((folder / "build.json").read_text()) == said:
            return folder
    except (OSError, ValueError):
        pass
    echo(f"peers_rerank: writing the run's float model as a CrossEncoder folder in {folder}")
    save_cross_encoder(load_model(recipe, source, None), folder)
    (folder / "build.json").write_text(json.dumps(said))
    return folder


def chosen_rows(exports: list[str], args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The rows to time, in table order: compress's `exports` and (unless --no-peers) the
    peers, narrowed by --rows. UserError for a name that is no row, or when nothing of
    compress's is left to time and the peers were not asked for by name."""
    names = exports + ([] if args.no_peers else list(PEERS))
    picked, unknown = select(names, args.rows)
    if unknown:
        raise UserError(f"no row named {', '.join(unknown)} (choices: {', '.join(names)})")
    if not set(picked) & set(exports) and (args.no_peers or not args.rows):
        raise UserError(f"{run_dir}: no finished export has a \"reranker\" block in its "
                        "export.json (run a reranker recipe with an export stage)")
    return picked


def compress_items(run_dir: Path, manifest: Any) -> list[dict[str, Any]]:
    """One row per reranker export of the run (export.json with a `reranker` block), in
    stage order."""
    from compress.report.rebench import artifacts_of
    from compress.report.runtimes import runtime_label

    items = []
    for artifact in artifacts_of(run_dir):
        folder = run_dir / artifact["folder"]
        try:
            meta = json.loads((folder / "export.json").read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(meta, dict) or not isinstance(meta.get("reranker"), dict):
            continue
        runtime = runtime_label(manifest, artifact["index"], artifact["config"])
        items.append({"name": artifact["name"], "kind": "compress", "folder": str(folder),
                      "runtime": f"compress {runtime}", "python": None, "peer": False,
                      "precision": "int8" if "int8" in runtime else "fp32",
                      "size_mb": _mb(folder / meta["file"]), "rounds": []})
    return items


def peer_items(run_dir: Path, model: Path, wanted: set[str]
               ) -> tuple[list[dict[str, Any]], dict[str, dict[str, str]]]:
    """The `wanted` peers' rows (each ready, or carrying why not) and the onnx
    environment's versions."""
    try:
        versions = {ONNX.name: ensure_venv(ONNX, echo)}
    except PeerError as exc:
        failed = {"error": f"{ONNX.name} environment: {exc}"}
        return [{"name": n, "peer": True, "rounds": [], **failed} for n in PEERS
                if n in wanted], {}
    built: dict[str, Any] | str = "not wanted"
    if wanted & {"st_onnx", "st_onnx_int8"}:
        built = st_onnx_build(run_dir, model, echo, cross_encoder=True)
    label = f"sentence-transformers {versions[ONNX.name].get('sentence-transformers', '?')}"
    isa = built.get("isa", "?") if isinstance(built, dict) else "?"
    common = {"peer": True, "python": str(ONNX.python()), "folder": str(model)}
    rows = [{**common, "name": "st_fp32", "kind": "ce", "precision": "fp32",
             "runtime": f"{label} CrossEncoder fp32 (torch)",
             "size_mb": _mb(model / "model.safetensors")},
            {**common, "name": "st_onnx", "kind": "ce_onnx", "precision": "fp32", "key": "fp32",
             "runtime": f"{label} CrossEncoder ONNX fp32"},
            {**common, "name": "st_onnx_int8", "kind": "ce_onnx", "precision": "int8",
             "key": "int8", "runtime": f"{label} CrossEncoder ONNX int8 dynamic ({isa})"}]
    for row in rows[1:]:
        if isinstance(built, dict):
            row.update(folder=built["folder"], file=built["files"][row["key"]],
                       size_mb=built["size_mb"][row["key"]])
        else:
            row["error"] = str(built)
    return [{**row, "rounds": []} for row in rows if row["name"] in wanted], versions


def _mb(path: Path) -> float | None:
    try:
        return round(path.stat().st_size / 2**20, 3)
    except OSError:
        return None


def measure(items: list[dict[str, Any]], pairs_file: Path, work: Path,
            args: argparse.Namespace) -> None:
    """The rounds: a fresh process per row, alternating order; the first round saves each
    row's scores as `<work>/<name>.npy`."""
    for r, item in alternating(items, args.rounds):
        if item.get("error"):
            continue
        spec = {k: item.get(k) for k in ("kind", "folder", "file")}
        spec.update(mode="rerank", pairs=str(pairs_file), batch=args.batch,
                    warmup=args.warmup, passes=args.passes, fixed=list(FIXED),
                    scores=str(work / f"{item['name']}.npy") if r == 0 else None)
        figures = run_module(item.get("python") or sys.executable, CHILD, spec)
        record(item, figures)
        echo(f"peers_rerank: round {r + 1}/{args.rounds}: {item['name']}: " + (
            f"failed: {item['error']}" if "error" in figures else
            f"{figures['items_per_s']} pairs/s (passes {figures['items_per_s_passes']})"))


def fidelity(scores: Any, reference: Any, examples: Any) -> dict[str, Any]:
    """The largest score difference and Kendall's tau per query against `reference`, and
    nDCG@10 / MRR@10 against the labels (compress/families/reranker/measures.py)."""
    import torch

    from compress.families.reranker.measures import agreement, ranking_quality
    from compress.families.reranker.pairs import groups_of

    ours, theirs = torch.as_tensor(scores).float(), torch.as_tensor(reference).float()
    if ours.shape != theirs.shape:
        return {"quality_error": f"{tuple(ours.shape)} scores against the reference's "
                                 f"{tuple(theirs.shape)}"}
    groups = groups_of(examples)
    return {**agreement(ours, theirs, groups),
            **ranking_quality(ours, examples.labels, groups)}


def reference_scores(work: Path, run_dir: Path, count: int) -> tuple[Any, str]:
    """The reference's scores (st_fp32's, else the run's own float model's) and its name."""
    import numpy as np

    saved = work / f"{REFERENCE}.npy"
    if saved.is_file():
        return np.load(saved), f"{REFERENCE}, `CrossEncoder.predict` on torch"
    return run_scores(run_dir, count), "the run's float model (its reranker_reference scores)"


def run_scores(run_dir: Path, count: int) -> Any:
    """The first `count` of the run's float model's scores of its eval pairs."""
    from safetensors.torch import load_file

    from compress.families.reranker.family import REFERENCE as RUN_REFERENCE

    return load_file(str(run_dir / RUN_REFERENCE))["scores"][:count].numpy()


def score_rows(items: list[dict[str, Any]], work: Path, run_dir: Path, examples: Any,
               reference: Any) -> list[str]:
    """Each measured row's fidelity; notes (the peers' model against the run's own)."""
    import numpy as np

    for item in items:
        saved = work / f"{item['name']}.npy"
        if saved.is_file():
            item["quality"] = fidelity(np.load(saved), reference, examples)
    notes = []
    if (work / f"{REFERENCE}.npy").is_file():
        check = fidelity(np.load(work / f"{REFERENCE}.npy"),
                         run_scores(run_dir, len(examples)), examples)
        notes.append(f"{REFERENCE} against the run's own float scores (the same weights): "
                     f"max abs Δscore {check.get('score_max_abs_diff', float('nan')):.2g}")
    return notes


def _main(args: argparse.Namespace) -> int:
    run_dir = args.run_dir.resolve()
    manifest = check_finished(run_dir)
    if manifest.model.get("task") != TASK:
        raise UserError(f"{run_dir}: not a reranker run (model task "
                        f"{manifest.model.get('task')!r}; run a reranker recipe, e.g. "
                        "recipes/rerank_int8.yaml)")
    items = compress_items(run_dir, manifest)
    picked = chosen_rows([i["name"] for i in items], args, run_dir)
    items = [i for i in items if i["name"] in picked]
    served = rerank_served.plan(args, run_dir)  # its user errors before any timing
    examples, recipe = eval_pairs(run_dir, args.limit)
    versions: dict[str, dict[str, str]] = {}
    work = Path(tempfile.mkdtemp(prefix="peers_rerank-"))
    with run_lock(run_dir, "a compress run is using this folder; time it when the run "
                  "has finished"):
        model = (float_model(run_dir, recipe) if not args.no_peers or served is not None
                 else None)
        if not args.no_peers:
            peers, versions = peer_items(run_dir, model, {REFERENCE, *(
                n for n in picked if n in PEERS)})
            items = peers + items
        pairs_file = work / "pairs.json"
        pairs_file.write_text(json.dumps({"pairs": [list(p) for p in zip(
            examples.texts, examples.pairs, strict=True)]}))
        measure(items, pairs_file, work, args)
        reference, reference_name = reference_scores(work, run_dir, len(examples))
        notes = score_rows(items, work, run_dir, examples, reference)
        served_items = rerank_served.run(served, args, run_dir, model, examples, work,
                                         lambda scores: fidelity(scores, reference, examples),
                                         versions)
    rows = table_rows(items)
    served_rows, served_lines = rerank_served.table(served_items, args)
    print(render_text(rows), end="")
    if served_items:
        print("\n" + rerank_served.render_text(served_rows, served_lines), end="")
    header = _header(args, recipe, model, examples, versions, reference_name, notes)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(rows, header)
    if served_items:
        markdown += "\n" + rerank_served.render_markdown(served_rows, served_lines, header)
    atomic_write_text(args.markdown, scrubbed(markdown))
    json_path = args.json or run_dir / "peers_rerank.json"
    atomic_write_json(json_path, scrubbed({
        "header": header, "items": items, "rows": rows, "served_items": served_items,
        "served_rows": served_rows, "served_ratios": served_lines}))
    echo(f"peers_rerank: wrote {args.markdown} and {json_path} (scores in {work})")
    failed = [i for i in items + served_items if i.get("error")] + [
        r for i in served_items for r in i["rounds"] if r.get("error")]
    return 1 if failed else 0


def _header(args: argparse.Namespace, recipe: Any, model: Path | None, examples: Any,
            versions: dict[str, dict[str, str]], reference: str, notes: list[str]
            ) -> dict[str, Any]:
    from compress.families.reranker.measures import TIE_MARGIN

    return {**results_header(MODULE, args.argv, peers={
                f"the peers' {name} environment": facts for name, facts in versions.items()}),
            "run": shown(args.run_dir),
            "model": f"{recipe.model.source}" + (f" (as a CrossEncoder folder: <run>/{MODEL})"
                                                 if model else ""),
            "pairs": len(examples), "queries": len(set(examples.texts)),
            "source": f"{recipe.data.source}, eval split", "batch": args.batch,
            "rounds": args.rounds, "passes": args.passes, "warmup": args.warmup,
            "reference": reference, "tie_margin": TIE_MARGIN, "notes": notes}


if __name__ == "__main__":
    sys.exit(main())

"""compress's artifacts next to the peers a user would run instead, all timed in one
invocation on this machine: Optimum's fp32 ONNX and its dynamic int8 at each `optimum-cli
export onnx --optimize` level (O1-O3) and OpenVINO's static int8 (NNCF), each on the
fine-tuned teacher (the user's model: the *product* ratio) and on the winner's own student
weights (the float model the winner was made from, found through the run's manifest: the
*like-for-like* ratio); Optimum's int8 of every other student a search fine-tuned on the
labels alone. From the repository root:

    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.classifier.peers runs/bert_search_chain
    python -m benchmarks.classifier.peers runs/bert_int8 --with-run runs/bert_bf16
    python -m benchmarks.classifier.peers runs/bert_int8 --rounds 6 --artifacts int8_aoti fp32_onnx
    python -m benchmarks.classifier.peers RUN --no-peers --rounds 1 --iters 2 --real-limit 16

Builds (once, cached in `<run>/peers/`) the peers' files in their own environment
(benchmarks/classifier/optimum.py, openvino.py), then measures every artifact in a fresh
process per round (benchmarks/classifier/child.py): accuracy on the full eval split (first
round), b1 and b8 x 128 (the recipe's harness), b1 and b8 on the eval sentences padded per
batch (OpenVINO's file by the same protocol in its own environment, openvino_child.py).
Rounds (default 5) alternate order; a round's figure is the median of its timed calls, a
row's figure the median over rounds of those. First a table of the winner (the search
stage's artifact, else the last stage's) against each peer at its best (Optimum's fastest
level at each length): the product and the like-for-like ratio, by median and by best round,
at 8 x 128 and at batch 8 real lengths, with both accuracies. Then every row: b1 ms,
b8x128 ms, b8 real ms, b1 real ms (medians over rounds); b8x128 min / max and b8 real min /
max (the fastest and the slowest round: with the median, the row's spread); accuracy %, size
MB; x faster b8x128 median / best and x faster b8 real median / best (Optimum int8's ms, its
fastest level on the teacher, / the row's: by median, the medians over rounds; by best, each
one's fastest round; above 1 the row is faster); % int8 peak. Every round's figure is kept
in the JSON (each row's `latency_ms_b8_rounds` and `latency_ms_b8_real_rounds`, each
artifact's `rounds`; the two ratios under `headline`). Why 5 rounds: the published ratios are
medians of at least 5 (issue 72); a round of the search chain's table (about 17 rows with
both peers on teacher and student at three levels) takes an estimated 5-6 minutes on 2
cores, so 5 rounds take about half an hour.
A GEMM microbenchmark (benchmarks/harness/gemm.py) runs in its own process before and after
the rounds (the better of the two is the peak). Prints one table, writes it as Markdown
(`--markdown`) and JSON (`--json`). Exit 2: a missing or unfinished run folder; 1: an
artifact, GEMM or peer failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks.classifier import optimum
from benchmarks.classifier.contenders import (
    items_of,
    other_run_items,
    peer_items,
    search_front_items,
    search_records,
)
from benchmarks.classifier.plot import plot_front
from benchmarks.classifier.table import (
    BATCHES,
    SEQ_LEN,
    headline,
    render_markdown,
    render_text,
    table_rows,
)
from benchmarks.harness import gemm
from benchmarks.harness.cli import echo, exit_code
from benchmarks.harness.paths import RESULTS, default_data_dir
from benchmarks.harness.provenance import results_header, shown
from benchmarks.harness.rounds import alternating, record, run_module
from benchmarks.harness.runs import check_finished, eval_recipe
from compress.errors import UserError
from compress.recipe.datasets import resolve_data
from compress.report.rebench import artifacts_of, latency_settings
from compress.report.runtimes import reference_index
from compress.runfolder.files import atomic_write_json, atomic_write_text, run_lock

CHILD = "benchmarks.classifier.child"  # run as python -m CHILD
MODULE = "benchmarks.classifier.peers"
DEFAULT_MARKDOWN = RESULTS / "peers.md"


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The JSON line of `python -m benchmarks.classifier.child SPEC`, or {"error": one
    line}."""
    return run_module(sys.executable, CHILD, spec)


def measure(run_dir: Path, items: list[dict[str, Any]], latency: dict[str, Any],
            args: argparse.Namespace) -> list[dict[str, Any]]:
    """GEMM, the rounds (alternating order, a fresh process per artifact), GEMM again."""
    runs = [gemm.run(args.gemm_shape)]
    echo(f"peers: GEMM peaks (before): {gemm.brief(runs[0])}")
    for r, item in alternating(items, args.rounds):
        if item.get("error"):
            continue
        if "python" in item:  # a peer measured in its own environment (OpenVINO)
            figures = run_module(item["python"], item["child"], {
                "mode": "measure", "folder": item["folder"], "source": item["source"],
                "latency": latency, "accuracy": r == 0, "real_limit": args.real_limit})
        else:
            figures = run_child({
                "mode": "artifact", "run_dir": item.get("run_dir", str(run_dir)),
                "folder": item["folder"], "kind": item["kind"], "config": item["config"],
                "latency": latency, "accuracy": r == 0, "real_limit": args.real_limit})
        record(item, figures)
        echo(f"peers: round {r + 1}/{args.rounds}: {item['name']}: " + (
            f"failed: {item['error']}" if "error" in figures else
            ", ".join(f"{k} {figures[k]}" for k in ("latency_ms_b1", "latency_ms_b8",
                                                    "latency_ms_b8_real") if k in figures)))
    runs.append(gemm.run(args.gemm_shape))
    echo(f"peers: GEMM peaks (after): {gemm.brief(runs[1])}")
    return runs


def gemm_shape(text: str) -> tuple[int, int, int]:
    """`MxKxN` as (m, k, n), each at least 1."""
    try:
        m, k, n = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not MxKxN (such as 256x384x384)") from None
    if min(m, k, n) < 1:
        raise argparse.ArgumentTypeError(f"'{text}': every size must be at least 1")
    return m, k, n


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time a finished run's artifacts and Optimum's fp32 and int8 ONNX of its "
                    "fine-tuned model in one invocation, each in a fresh process.")
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a finished run folder")
    parser.add_argument("--with-run", type=Path, action="append", default=[],
                        metavar="RUN_DIR", help="also time this finished run's artifacts "
                        "(another recipe on the same fine-tuned model); repeatable")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds, alternating order (default 5: the medians of the "
                        "published ratios are of at least 5)")
    parser.add_argument("--optimum-levels", default=",".join(optimum.LEVELS), metavar="LEVELS",
                        help="optimum-cli export onnx --optimize levels, an int8 row each on "
                        f"the teacher and the student; the fastest is the peer at its best "
                        f"(default {','.join(optimum.LEVELS)})")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip Optimum (no peer environment, no package index needed)")
    parser.add_argument("--artifacts", nargs="+", metavar="NAME",
                        help="time only these compress artifacts (names or stage indexes)")
    parser.add_argument("--iters", type=int, help="timed iterations (default: the recipe's)")
    parser.add_argument("--warmup", type=int, help="untimed iterations (default: the recipe's)")
    parser.add_argument("--real-limit", type=int, metavar="N",
                        help="time real lengths on the first N eval sentences (default all)")
    parser.add_argument("--gemm-shape", type=gemm_shape, action="append", metavar="MxKxN",
                        help="a GEMM microbenchmark shape (repeatable; default "
                        "1024x1024x1024 and MiniLM's 1024x384x1536, where an emulated bf16 "
                        "or int8 product can take seconds a call)")
    parser.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN, metavar="PATH",
                        help="the table as Markdown (default benchmarks/results/peers.md)")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="every figure as JSON (default RUN_DIR/peers.json)")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the header's command
    for name in ("rounds", "iters", "real_limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    args.optimum_levels = [level for level in args.optimum_levels.split(",") if level]
    unknown = [level for level in args.optimum_levels if level not in optimum.LEVELS]
    if unknown or not args.optimum_levels:
        parser.error(f"--optimum-levels: {', '.join(unknown) or 'none'} (known on a CPU: "
                     f"{', '.join(optimum.LEVELS)}; O4 is fp16 on CUDA)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure and report; 0, 1 when anything failed, 2 for a user error."""
    args = parse_args(argv)
    default_data_dir()  # the children read the eval split
    return exit_code(lambda: _main(args), peer="Optimum peer: ")


def _main(args: argparse.Namespace) -> int:
    run_dir = args.run_dir.resolve()
    manifest = check_finished(run_dir)
    if not artifacts_of(run_dir):
        raise UserError(f"{run_dir}: no finished stage saved a model or an export to time")
    resolve_data(eval_recipe(run_dir).data.source)  # the children read its eval split
    latency = {**latency_settings(run_dir, args.iters, args.warmup, None),
               "batch_sizes": list(BATCHES), "seq_len": SEQ_LEN, "seq_lens": None}
    with run_lock(run_dir, "a compress run is using this folder; time it when the run "
                  "has finished"):
        items, peer_facts = items_of(run_dir, manifest, args.artifacts), None
        items += search_front_items(run_dir, manifest) if not args.artifacts else []
        items += other_run_items(args.with_run, items)
        student, failed_levels = None, {}
        if not args.no_peers:
            peers, peer_facts, student = peer_items(run_dir, manifest, echo,
                                                    args.optimum_levels, failed_levels)
            items += peers
        runs = measure(run_dir, items, latency, args)
    peaks = gemm.peaks(runs)
    rows = table_rows(items, peaks["int8_gops"])
    peers = None
    if peer_facts is not None:  # OpenVINO and NNCF go into Optimum's environment
        found = dict(peer_facts)
        for item in items:
            found.update(item.get("versions") or {})
        peers = {"the peers' environment (Optimum, OpenVINO)": found}
    header = {**results_header(MODULE, args.argv, peers=peers, peaks=peaks),
              "run": ", ".join(shown(p) for p in [args.run_dir, *args.with_run]),
              "rounds": args.rounds, "iters": latency["iters"], "warmup": latency["warmup"],
              "eval_size": next((r.get("eval_size") for r in rows if r.get("eval_size")), None),
              "real_limit": args.real_limit, "student": student,
              "optimum_levels": None if args.no_peers else args.optimum_levels,
              "optimum_failed": failed_levels}
    print(render_text(rows), end="")
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    searches = [record for _, _, record in search_records(run_dir, manifest)]
    first = reference_index(manifest)
    picture = plot_front(rows, args.markdown.with_suffix(".png"),
                         next((i["name"] for i in items if i.get("index") == first), None),
                         searches[0]["max_accuracy_drop"] if searches else None)
    markdown = render_markdown(rows, header)
    if picture is not None:
        markdown += f"\n![accuracy against b8 x 128 latency]({picture.name})\n"
    atomic_write_text(args.markdown, markdown)
    atomic_write_json(args.json or run_dir / "peers.json",
                      {"header": header, "settings": latency, "gemm_runs": runs,
                       "artifacts": items, "rows": rows, "headline": headline(rows)})
    echo(f"peers: wrote {args.markdown} and {args.json or run_dir / 'peers.json'}")
    failed = [g for g in runs if "error" in g] + [i for i in items if i.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

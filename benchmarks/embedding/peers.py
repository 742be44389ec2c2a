"""A finished embedding run's exports next to what a user would run instead on the same
source model, all timed in one invocation on this machine. From the repository root:

    COMPRESS_DATA_DIR=../shared/data python -m benchmarks.embedding.peers runs/embed_int8
    python -m benchmarks.embedding.peers RUN --rounds 1 --limit 64 --passes 1   # a smoke run
    python -m benchmarks.embedding.peers RUN --no-peers          # compress's exports alone

Rows: sentence-transformers fp32 (torch; the reference), its ONNX dynamic int8 with this
CPU's config, its OpenVINO static int8, fastembed on the ONNX export and on the int8 file
(peers built once per source model, in their own environments: venvs.py, child.py), the
same peers on our student's float weights (`student_...`, the like-for-like rows: the
sentence-transformers folder the exports were made from, student.py, or `--student`), and
every export of the run whose export.json says `"outputs": ["embedding"]` (items.py). Each
row is timed in a fresh process per round (child.py), rounds alternating order: the whole
list of eval texts in one call a pass with the batch size, as a user calls each library
(sentence-transformers sorts it by length itself), texts in and embeddings out. Fidelity
and recall@10 are against sentence-transformers fp32's embeddings on the user's model
(quality.py); the int8 GEMM peak is benchmarks/harness/gemm.py's microbenchmark, before
and after the rounds. Prints the table and the two ratios, product and like for like
(table.py), writes Markdown, JSON and a plot. A peer whose environment lacks its library
(fastembed, OpenVINO) is left out with a one-line reason. Exit 2: a missing or unfinished
run, no embedding export, bad arguments; 1: a row, a build, an environment or the GEMM
benchmark failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.embedding import quality
from benchmarks.embedding.items import (
    CHILD,
    PEERS,
    STUDENT,
    compress_items,
    peer_items,
)
from benchmarks.embedding.student import is_float_folder, made_from
from benchmarks.embedding.table import (
    plot_rows,
    render_markdown,
    render_text,
    select,
    table_rows,
    two_ratios,
)
from benchmarks.harness import gemm
from benchmarks.harness.cli import echo, exit_code
from benchmarks.harness.paths import RESULTS, default_data_dir
from benchmarks.harness.provenance import results_header, scrubbed, shown
from benchmarks.harness.rounds import alternating, record, run_module
from benchmarks.harness.runs import check_finished, eval_recipe
from compress.errors import UserError
from compress.runfolder.files import (
    atomic_write_json,
    atomic_write_text,
    run_lock,
    sha256_file,
)

DEFAULT_MARKDOWN = RESULTS / "peers_embed.md"
MODULE = "benchmarks.embedding.peers"
REFERENCE = "st_fp32"  # fidelity and recall@10 are against this row's embeddings


# the fixed shape each row is also timed at (batch, tokens), as peers.py times classifiers
FIXED = (8, 128)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help="a finished run of an embedding recipe")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, alternating order (3)")
    parser.add_argument("--limit", type=int, metavar="N", help="the first N eval texts (all)")
    parser.add_argument("--passes", type=int, default=3,
                        help="timed passes per process, each one call on the whole list; a "
                             "round is their median (3)")
    parser.add_argument("--warmup", type=int, default=3, help="one untimed call first on "
                        "this many batches' texts (3: the first 3 x --batch)")
    parser.add_argument("--batch", type=int, default=32, help="texts per batch (32)")
    parser.add_argument("--rows", nargs="+", metavar="NAME", help="time only these rows "
                        f"(peers: {', '.join(PEERS)}, and {STUDENT}<peer> on the student; "
                        f"compress's: its artifact names); {REFERENCE} is always timed with "
                        "the peers")
    parser.add_argument("--no-peers", action="store_true", help="compress's exports alone "
                        "(no environment; fidelity against the run's own reference)")
    parser.add_argument("--student", type=Path, metavar="FOLDER", help="the float "
                        "sentence-transformers folder every export was made from, for the "
                        "like-for-like rows (default: found in the run, student.py)")
    parser.add_argument("--no-student", action="store_true", help="no like-for-like rows on "
                        "the student's weights")
    parser.add_argument("--one-pass", action="store_true", help="also time each of "
                        "compress's exports with a batch in one pass (`NAME one pass`: the "
                        "handlers' length_buckets off)")
    parser.add_argument("--no-gemm", action="store_true", help="skip the int8 GEMM peak")
    parser.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN, metavar="PATH",
                        help="the table as Markdown (benchmarks/results/peers_embed.md)")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="every figure (default RUN_DIR/peers_embed.json)")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # the header's command
    for name in ("rounds", "limit", "passes", "batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure and report; 0, 1 when anything failed, 2 for a user error."""
    default_data_dir()  # the SST-2 mirror beside the repository, unless one is named
    return exit_code(lambda: _main(parse_args(argv)))


def eval_texts(run_dir: Path, limit: int | None) -> tuple[list[str], Any, Any]:
    """(the run's eval texts, the first `limit`; its recipe; the resolved data source)."""
    from compress.data.datasets import load_data
    from compress.recipe.datasets import resolve_data

    recipe = eval_recipe(run_dir)
    source = resolve_data(recipe.data.source)
    texts = load_data(recipe, source, labels_required=False).splits["eval"].texts
    return list(texts[:limit] if limit else texts), recipe, source


def source_model(recipe: Any) -> tuple[Path, dict[str, Any]]:
    """The recipe's sentence-transformers folder and its layout."""
    from compress.recipe.sources import resolve_model

    folder = Path(resolve_model(recipe.model.source, None).location)
    return folder, layout_of(folder)


def layout_of(folder: Path) -> dict[str, Any]:
    """A sentence-transformers folder's pooling, normalization, width and max length."""
    from compress.families.embedding.layout import read_layout

    layout = read_layout(folder)
    width = json.loads((folder / "config.json").read_text()).get("hidden_size")
    return {"pooling": "+".join(layout.pooling), "normalize": layout.normalize,
            "dimensions": width, "max_seq_length": layout.max_seq_length or 512}


def find_student(args: argparse.Namespace, items: list[dict[str, Any]]
                 ) -> tuple[Path | None, str]:
    """Our student (the float folder the exports were made from: `--student`, else found
    in the run by student.py; None for exports of the source's own weights or with
    `--no-student`), each item's "weights" set against it, and a note saying which."""
    if args.no_student:
        for item in items:
            item["weights"] = "source" if item["weights"] == "source" else "other"
        return None, "like for like: not measured (--no-student)"
    if args.student is not None:
        student = args.student.resolve()
        if not is_float_folder(student):
            raise UserError(f"--student {args.student}: not a float sentence-transformers "
                            "folder (modules.json and model.safetensors, no model.pt2)")
        for item in items:
            item.update(weights="student", model=str(student))
        return student, f"like for like: the peers run on `{shown(student)}` (--student)"
    folders = list(dict.fromkeys(Path(i["model"]) for i in items if i.get("model")))
    student, count = (folders[-1] if folders else None), len(folders)
    for item in items:
        if item.get("model"):
            item["weights"] = "student" if Path(item["model"]) == student else "other"
    if student is None:
        return None, ("like for like: the exports are made from the source model's own "
                      "weights, so the peers on the user's model are the like-for-like peers")
    note = f"like for like: the peers run on our student, `{shown(student)}`"
    if count > 1:
        note += (f" (the exports come from {count} float models: one made from another has "
                 "no like-for-like ratio)")
    return student, note


def calibration_of(recipe: Any, data_source: Any) -> dict[str, Any] | None:
    """Where OpenVINO's int8 is calibrated: the run's calibration split (else train) and
    text column of its data folder, never the eval texts; None without local files."""
    if data_source.kind != "files":
        return None
    split = recipe.data.calibration.split if recipe.data.calibration else "train"
    return {"dataset": data_source.location, "split": split,
            "column": recipe.data.text_column}


def measure(items: list[dict[str, Any]], texts_file: Path, work: Path,
            args: argparse.Namespace) -> None:
    """The rounds: a fresh process per row, alternating order; the first round saves each
    row's embeddings as `<work>/<name>.npy`."""
    for r, item in alternating(items, args.rounds):
        if item.get("error"):
            continue
        spec = {k: item.get(k) for k in ("kind", "folder", "file", "pooling", "normalize",
                                         "dimensions", "length_buckets")}
        spec.update(mode="measure", texts=str(texts_file), batch=args.batch,
                    warmup=args.warmup, passes=args.passes, fixed=list(FIXED),
                    embeddings=str(work / f"{item['name']}.npy") if r == 0 else None)
        figures = run_module(item.get("python") or sys.executable, CHILD, spec)
        record(item, figures)
        echo(f"peers_embed: round {r + 1}/{args.rounds}: {item['name']}: " + (
            f"failed: {item['error']}" if "error" in figures else
            f"{figures['items_per_s']} sentences/s (passes {figures['items_per_s_passes']})"))


def _main(args: argparse.Namespace) -> int:
    run_dir = args.run_dir.resolve()
    check_finished(run_dir)
    from compress.runfolder.records import require_manifest

    manifest = require_manifest(run_dir)
    texts, recipe, data_source = eval_texts(run_dir, args.limit)
    source, layout = source_model(recipe)
    items = compress_items(run_dir, manifest, args.one_pass, made_from(run_dir, manifest.stages))
    student, student_note = find_student(args, items)
    peer_names = [] if args.no_peers else [
        *PEERS, *([STUDENT + name for name in PEERS] if student is not None else [])]
    names = [i["name"] for i in items] + peer_names
    picked, unknown = select(names, args.rows)
    if unknown:
        raise UserError(f"no row named {', '.join(unknown)} (choices: {', '.join(names)})")
    items = [i for i in items if i["name"] in picked]
    if not items and (args.no_peers or not args.rows):
        raise UserError(f"{run_dir}: no finished export says \"outputs\": [\"embedding\"] "
                        "(run an embedding recipe, e.g. recipes/embed_int8.yaml)")
    versions: dict[str, dict[str, str]] = {}
    absent: list[dict[str, Any]] = []
    with run_lock(run_dir, "a compress run is using this folder; time it when the run "
                  "has finished"):
        if not args.no_peers:
            wanted = {REFERENCE, *(n for n in picked if n in peer_names)}
            mine = None if student is None else (
                student, sha256_file(student / "model.safetensors"), layout_of(student))
            peers, versions, absent = peer_items(run_dir, source, sha256_file(
                source / "model.safetensors"), calibration_of(recipe, data_source), layout,
                echo, wanted, mine)
            items = peers + items
        work = Path(tempfile.mkdtemp(prefix="peers_embed-"))
        texts_file = work / "texts.json"
        texts_file.write_text(json.dumps({"texts": texts}))
        runs = [] if args.no_gemm else [gemm.run()]
        measure(items, texts_file, work, args)
        runs += [] if args.no_gemm else [gemm.run()]
    reference = work / f"{REFERENCE}.npy"
    notes = quality.score_rows(items, work, reference if reference.is_file() else None,
                               run_dir, len(texts))
    if not args.no_peers:
        notes.append(student_note)
    notes += quality.assign_flops(items, source, texts, args.batch, layout["max_seq_length"],
                                  FIXED)
    shapes = quality.pass_shapes(quality.batch_lengths(source, texts, args.batch,
                                                       layout["max_seq_length"]))
    peak = gemm.peaks(runs)["int8_gops"] if runs else None
    notes.append(f"b{FIXED[0]}x{FIXED[1]}: a batch of {FIXED[0]} texts of {FIXED[1]} tokens "
                 "each in one call, texts in, embeddings out (15 calls after the warm-up, the "
                 "median), and the model alone on it tokenized once")
    rows = table_rows(items, None, len(texts), peak)
    print(render_text(rows, absent), end="")
    header = _header(args, recipe, source, texts, versions, runs, shapes, notes)
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(rows, header, absent)
    picture = plot_rows(rows, args.markdown.with_suffix(".png"))
    if picture is not None:
        markdown += f"\n![sentences/s against fidelity]({picture.name})\n"
    atomic_write_text(args.markdown, scrubbed(markdown))
    json_path = args.json or run_dir / "peers_embed.json"
    atomic_write_json(json_path, scrubbed({"header": header, "gemm_runs": runs, "items": items,
                                           "rows": rows, "ratios": two_ratios(rows),
                                           "absent": absent}))
    echo(f"peers_embed: wrote {args.markdown} and {json_path} (embeddings in {work})")
    failed = [g for g in runs if "error" in g] + [i for i in items if i.get("error")] + [
        a for a in absent if a.get("failed")]
    return 1 if failed else 0


def _header(args: argparse.Namespace, recipe: Any, source: Path, texts: list[str],
            versions: dict[str, dict[str, str]], runs: list[dict[str, Any]], shapes: list,
            notes: list[str]) -> dict[str, Any]:
    peaks = gemm.peaks(runs) if runs else None
    return {**results_header(MODULE, args.argv, peers={f"the peers' {name} environment": facts
                                    for name, facts in versions.items()}, peaks=peaks),
            "run": shown(args.run_dir), "model": f"{recipe.model.source} ({shown(source)})",
            "texts": len(texts), "source": f"{recipe.data.source}, eval split",
            "batch": args.batch, "mean_tokens": quality.mean_tokens(shapes),
            "rounds": args.rounds, "passes": args.passes, "warmup": args.warmup,
            "int8_gops": (peaks or {}).get("int8_gops"), "notes": notes}


if __name__ == "__main__":
    sys.exit(main())

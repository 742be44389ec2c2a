"""compress's artifacts next to Optimum's fp32 and int8 ONNX of the same fine-tuned model,
all timed in one invocation on this machine. From the repository root:

    COMPRESS_DATA_DIR=../shared/data python benchmarks/peers.py runs/bert_int8
    python benchmarks/peers.py runs/bert_int8 --with-run runs/bert_bf16
    python benchmarks/peers.py runs/bert_int8 --rounds 3 --artifacts int8_aoti fp32_onnx
    python benchmarks/peers.py RUN --no-peers --rounds 1 --iters 2 --real-limit 16

Builds (once, cached in `<run>/peers/`) Optimum's ONNX of the run's fine-tuned model in
Optimum's own environment (benchmarks/peers_optimum.py), then measures every artifact in a
fresh process per round (benchmarks/peers_child.py): accuracy on the full eval split (first
round), b1 and b8 x 128 (the recipe's harness), b1 and b8 on the eval sentences padded per
batch. Rounds alternate order; a figure is the median over rounds of each round's median.
A GEMM microbenchmark runs in its own process before and after the rounds (the better of
the two is the peak). Prints one table, writes it as Markdown (`--markdown`) and JSON
(`--json`). Exit 2: a missing or unfinished run folder; 1: an artifact, GEMM or peer failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from compress.errors import UserError, one_line
from compress.rebench import _select, _settings, artifacts_of, run_json_child
from compress.records import Manifest, require_manifest
from compress.runfolder import atomic_write_json, atomic_write_text, now, run_lock
from compress.runtimes import producer, reference_index, runtime_label
from compress.sources import resolve_data
from compress.stages.export_spec import SPEC as EXPORT_SPEC

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings, also when run as a file
import peers_optimum as optimum  # noqa: E402
from peers_child import eval_recipe  # noqa: E402
from peers_table import (  # noqa: E402
    BATCHES,
    FLOPS_BATCH,
    SEQ_LEN,
    forward_flops,
    render_markdown,
    render_text,
    table_rows,
)

REPO = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).resolve().with_name("peers_child.py")
DEFAULT_MARKDOWN = REPO / "benchmarks" / "results" / "peers.md"
PEER_LABELS = {"optimum_fp32": "ONNX Runtime fp32 (Optimum)",
               "optimum_int8": f"ONNX Runtime int8 dynamic (Optimum {optimum.QUANTIZE_ISA})"}


def echo(text: str) -> None:  # progress goes to stderr; stdout has the table alone
    print(text, file=sys.stderr, flush=True)


def check_finished(run_dir: Path) -> Manifest:
    """The manifest of a run whose every recipe stage finished, else a UserError."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such folder (a run folder is made by compress run "
                        f"RECIPE)")
    manifest = require_manifest(run_dir)
    wanted = len(manifest.recipe_stages())
    for i in range(wanted):
        entry = manifest.stages[i] if i < len(manifest.stages) else None
        if entry is None or not entry.finished_ok:
            state = entry.status if entry is not None else "not started"
            name = entry.name if entry is not None else manifest.recipe_stages()[i].get("kind")
            raise UserError(f"{run_dir}: unfinished run (stage {i} {name}: {state}); run its "
                            f"recipe again to finish it")
    return manifest


def flops_of(run_dir: Path, manifest: Manifest, index: int) -> tuple[float | None, str]:
    """FLOPs of one 8 x 128 forward of stage `index`'s model, from the config.json of its
    own folder or, failing that, of the model it was made from; and where they came from."""
    entry, pruned, own = manifest.stages[index], False, True
    while entry is not None:
        output = entry.outputs[0] if entry.outputs else None
        folder = output and (output.model_dir or output.export_dir)
        if folder and (run_dir / folder / "structure.json").is_file():
            pruned = True
        if folder and (run_dir / folder / "config.json").is_file():
            config = json.loads((run_dir / folder / "config.json").read_text())
            try:
                flops = forward_flops(config)
            except KeyError as exc:
                return None, f"no FLOPs: {folder}/config.json: {exc.args[0]}"
            whose = "its own config" if own else "the config of the model it was made from"
            note = (f"FLOPs {flops / 1e9:.2f} G at {FLOPS_BATCH} x {SEQ_LEN} from "
                    f"{folder}/config.json ({whose})")
            if pruned:
                note += "; pruned units not subtracted, so % int8 peak is an upper bound"
            return flops, note
        entry, own = producer(manifest, entry), False
    return None, "no FLOPs: no config.json in its folder or its source's"


def peer_source(run_dir: Path, manifest: Manifest) -> tuple[int, Path, str]:
    """(stage index, folder, weights sha256) of the fine-tuned Hugging Face model that
    Optimum exports: the reference stage's, else the first plain HF model folder."""
    first = reference_index(manifest)
    order = ([first] if first is not None else []) + list(range(len(manifest.stages)))
    for i in order:
        entry = manifest.stages[i]
        output = entry.outputs[0] if entry.outputs else None
        folder = run_dir / output.model_dir if output and output.model_dir else None
        if (folder and (folder / "config.json").is_file() and entry.finished_ok
                and not any((folder / f).exists() for f in ("structure.json", "model.pt2"))):
            return i, folder, output.sha256
    raise UserError(f"{run_dir}: no fine-tuned Hugging Face model folder for Optimum to "
                    f"export (time compress's artifacts alone with --no-peers)")


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The JSON line of `python benchmarks/peers_child.py SPEC`, or {"error": one line}."""
    return run_json_child([sys.executable, str(CHILD), json.dumps(spec)])


def items_of(run_dir: Path, manifest: Manifest, names: list[str] | None
             ) -> list[dict[str, Any]]:
    """The compress artifacts to time: name, folder, kind, config, label, size, FLOPs."""
    items = []
    for art in _select(artifacts_of(run_dir), names):
        entry = manifest.stages[art["index"]]
        flops, source = flops_of(run_dir, manifest, art["index"])
        items.append({**art, "runtime": runtime_label(manifest, art["index"], art["config"]),
                      "size_mb": entry.outputs[0].bytes / 1e6 if entry.outputs[0].bytes
                      else None, "sha256": entry.outputs[0].sha256, "flops": flops,
                      "flops_source": source, "rounds": []})
    return items


def other_run_items(others: list[Path], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The artifacts of other finished runs (`--with-run`, for example runs/bert_bf16 beside
    runs/bert_int8), named RUN/NAME; a file already in the table (the same fine-tuned
    model in both runs) is timed once."""
    seen, found = {i["sha256"] for i in items}, []
    for other in others:
        other = other.resolve()
        for item in items_of(other, check_finished(other), None):
            if item["sha256"] not in seen:
                seen.add(item["sha256"])
                found.append({**item, "name": f"{other.name}/{item['name']}",
                              "run_dir": str(other)})
    return found


def peer_items(run_dir: Path, manifest: Manifest
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Build (or reuse) Optimum's two files; their items and the environment's facts."""
    index, source, sha = peer_source(run_dir, manifest)
    facts = optimum.ensure_venv(optimum.venv_path(), echo)
    labels = list((manifest.labels or {}).get("names") or [])
    if not labels:
        config = json.loads((source / "config.json").read_text())
        id2label = config.get("id2label") or {}
        labels = [id2label[k] for k in sorted(id2label, key=int)]
    folders = optimum.build_peers(run_dir, source, sha, labels, optimum.venv_path(), facts,
                                  echo)
    flops, note = flops_of(run_dir, manifest, index)
    note = note.replace("its own config", "the config of the model Optimum exported")
    kind = EXPORT_SPEC.kind  # loaded by the export kind's reload, as compress's own ONNX
    return [{"name": f.name, "kind": kind, "folder": str(f.relative_to(run_dir)),
             "config": {"kind": kind, "format": "onnx"}, "runtime": PEER_LABELS[f.name],
             "size_mb": (f / "model.onnx").stat().st_size / 1e6, "flops": flops,
             "flops_source": note, "rounds": []} for f in folders], facts


def gemm_peaks(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The better of the GEMM runs per precision (None where none succeeded)."""
    ok = [r for r in runs if "error" not in r]
    return {key: max((r[key] for r in ok), default=None)
            for key in ("fp32_gflops", "bf16_gflops", "int8_torch_gops", "int8_ort_gops",
                        "int8_gops")}


def measure(run_dir: Path, items: list[dict[str, Any]], latency: dict[str, Any],
            args: argparse.Namespace) -> list[dict[str, Any]]:
    """GEMM, the rounds (alternating order, a fresh process per artifact), GEMM again."""
    gemm = [run_child({"mode": "gemm"})]
    echo(f"peers: GEMM peaks (before): {_brief(gemm[0])}")
    for r in range(args.rounds):
        for item in items if r % 2 == 0 else items[::-1]:
            if item.get("error"):
                continue
            spec = {"mode": "artifact", "run_dir": item.get("run_dir", str(run_dir)),
                    "folder": item["folder"],
                    "kind": item["kind"], "config": item["config"], "latency": latency,
                    "accuracy": r == 0, "real_limit": args.real_limit,
                    "sys_path": [p for p in sys.path if p]}
            figures = run_child(spec)
            if "error" in figures:
                item["error"] = figures["error"]
            else:
                item["rounds"].append(figures)
            echo(f"peers: round {r + 1}/{args.rounds}: {item['name']}: " + (
                f"failed: {item['error']}" if "error" in figures else
                ", ".join(f"{k} {figures[k]}" for k in ("latency_ms_b1", "latency_ms_b8",
                                                         "latency_ms_b8_real") if k in figures)))
    gemm.append(run_child({"mode": "gemm"}))
    echo(f"peers: GEMM peaks (after): {_brief(gemm[1])}")
    return gemm


def _brief(gemm: dict[str, Any]) -> str:
    return f"failed: {gemm['error']}" if "error" in gemm else (
        f"fp32 {gemm['fp32_gflops']} GFLOP/s, bf16 {gemm['bf16_gflops']} GFLOP/s, "
        f"int8 {gemm['int8_gops']} GOP/s (torch._int_mm {gemm.get('int8_torch_gops')}, "
        f"ONNX Runtime {gemm.get('int8_ort_gops')})")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time a finished run's artifacts and Optimum's fp32 and int8 ONNX of its "
                    "fine-tuned model in one invocation, each in a fresh process.")
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a finished run folder")
    parser.add_argument("--with-run", type=Path, action="append", default=[],
                        metavar="RUN_DIR", help="also time this finished run's artifacts "
                        "(another recipe on the same fine-tuned model); repeatable")
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds, alternating order (default 2)")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip Optimum (no peer environment, no package index needed)")
    parser.add_argument("--artifacts", nargs="+", metavar="NAME",
                        help="time only these compress artifacts (names or stage indexes)")
    parser.add_argument("--iters", type=int, help="timed iterations (default: the recipe's)")
    parser.add_argument("--warmup", type=int, help="untimed iterations (default: the recipe's)")
    parser.add_argument("--real-limit", type=int, metavar="N",
                        help="time real lengths on the first N eval sentences (default all)")
    parser.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN, metavar="PATH",
                        help="the table as Markdown (default benchmarks/results/peers.md)")
    parser.add_argument("--json", type=Path, metavar="PATH",
                        help="every figure as JSON (default RUN_DIR/peers.json)")
    args = parser.parse_args(argv)
    for name in ("rounds", "iters", "real_limit"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure and report; 0, 1 when anything failed, 2 for a user error."""
    args = parse_args(argv)
    mirror = REPO.parent / "shared" / "data"
    if not os.environ.get("COMPRESS_DATA_DIR") and mirror.is_dir():
        os.environ["COMPRESS_DATA_DIR"] = str(mirror)  # the children read the eval split
    try:
        return _main(args)
    except UserError as exc:
        for message in exc.messages:
            print(f"error: {message}", file=sys.stderr)
        return 2
    except optimum.PeerError as exc:
        print(f"error: Optimum peer: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line, no traceback
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    run_dir = args.run_dir.resolve()
    manifest = check_finished(run_dir)
    if not artifacts_of(run_dir):
        raise UserError(f"{run_dir}: no finished stage saved a model or an export to time")
    resolve_data(eval_recipe(run_dir).data.source)  # the children read its eval split
    latency = {**_settings(run_dir, args.iters, args.warmup, None),
               "batch_sizes": list(BATCHES), "seq_len": SEQ_LEN, "seq_lens": None}
    with run_lock(run_dir, "a compress run is using this folder; time it when the run "
                  "has finished"):
        items, peer_facts = items_of(run_dir, manifest, args.artifacts), None
        items += other_run_items(args.with_run, items)
        if not args.no_peers:
            peers, peer_facts = peer_items(run_dir, manifest)
            items += peers
        gemm = measure(run_dir, items, latency, args)
    peaks = gemm_peaks(gemm)
    rows = table_rows(items, peaks["int8_gops"])
    env = next((g["environment"] for g in gemm if "environment" in g), {})
    cpu = env.get("cpu") or {}
    isa = cpu.get("isa") or {}
    header = {"date": now(), "run": ", ".join(map(str, [args.run_dir, *args.with_run])),
              "cpu": cpu.get("model"),
              "cores": cpu.get("cores"),
              "isa": {"avx512_vnni": isa.get("avx512_vnni"), "avx512_bf16": isa.get("avx512_bf16"),
                      "amx": any(v for k, v in isa.items() if k.startswith("amx"))},
              "versions": {k: v for k, v in (env.get("libraries") or {}).items()
                           if k in ("torch", "torchao", "transformers", "onnxruntime")},
              "rounds": args.rounds, "iters": latency["iters"], "warmup": latency["warmup"],
              "eval_size": next((r.get("eval_size") for r in rows if r.get("eval_size")), None),
              "real_limit": args.real_limit, "gemm": peaks}
    if peer_facts is not None:
        header["versions"]["optimum-onnx"] = peer_facts.get("optimum-onnx")
    print(render_text(rows), end="")
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.markdown, render_markdown(rows, header))
    atomic_write_json(args.json or run_dir / "peers.json",
                      {"header": header, "settings": latency, "gemm_runs": gemm,
                       "artifacts": items, "rows": rows})
    echo(f"peers: wrote {args.markdown} and {args.json or run_dir / 'peers.json'}")
    failed = [g for g in gemm if "error" in g] + [i for i in items if i.get("error")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""What benchmarks/classifier/peers.py times: a finished run's artifacts (and those of other
runs on the same model, `--with-run`), each with its runtime, size and FLOPs at 8 x 128, and
Optimum's two files of the run's fine-tuned model, built or reused (optimum.py)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.classifier import openvino, optimum
from benchmarks.harness.flops import FLOPS_BATCH, SEQ_LEN, forward_flops
from benchmarks.harness.runs import check_finished
from benchmarks.harness.venv import ensure_venv
from compress.errors import UserError
from compress.models.folders import STRUCTURE
from compress.recipe.kinds.export import SPEC as EXPORT_SPEC
from compress.recipe.kinds.search import CANDIDATES
from compress.report.plot import pareto_front
from compress.report.rebench import artifacts_of, select_artifacts
from compress.report.runtimes import producer, reference_index, runtime_label
from compress.runfolder.files import sha256_file
from compress.runfolder.records import Manifest

PEER_LABELS = {"optimum_fp32": "ONNX Runtime fp32 (Optimum)",
               "optimum_int8": f"ONNX Runtime int8 dynamic (Optimum {optimum.QUANTIZE_ISA})"}


def flops_of(run_dir: Path, manifest: Manifest, index: int) -> tuple[float | None, str]:
    """FLOPs of one 8 x 128 forward of stage `index`'s model, from the config.json of its
    own folder or, failing that, of the model it was made from, with the shapes pruning
    left (the nearest structure.json on the way); and where they came from."""
    entry, structure, own = manifest.stages[index], None, True
    while entry is not None:
        output = entry.outputs[0] if entry.outputs else None
        folder = output and (output.model_dir or output.export_dir)
        if folder and structure is None and (run_dir / folder / STRUCTURE).is_file():
            structure = (folder, json.loads((run_dir / folder / STRUCTURE).read_text()))
        if folder and (run_dir / folder / "config.json").is_file():
            config = json.loads((run_dir / folder / "config.json").read_text())
            try:
                flops = forward_flops(config, structure=structure and structure[1])
            except KeyError as exc:
                return None, f"no FLOPs: {folder}/config.json: {exc.args[0]}"
            whose = "its own config" if own else "the config of the model it was made from"
            note = (f"FLOPs {flops / 1e9:.2f} G at {FLOPS_BATCH} x {SEQ_LEN} from "
                    f"{folder}/config.json ({whose})")
            if structure:
                note += f", the pruned shapes from {structure[0]}/{STRUCTURE}"
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


def items_of(run_dir: Path, manifest: Manifest, names: list[str] | None
             ) -> list[dict[str, Any]]:
    """The compress artifacts to time: name, folder, kind, config, label, size, FLOPs."""
    items = []
    for art in select_artifacts(artifacts_of(run_dir), names):
        entry = manifest.stages[art["index"]]
        flops, source = flops_of(run_dir, manifest, art["index"])
        runtime = runtime_label(manifest, art["index"], art["config"])
        record_path = run_dir / f"{entry.index:02d}-{entry.name}" / "search.json"
        if entry.kind == "search" and record_path.is_file():  # a winner on a smaller shape
            record = json.loads(record_path.read_text())
            won = next((t for t in record["trials"] if t["id"] == record.get("winner")), {})
            if won.get("shape"):
                flops, source = shape_flops(record_path.parent, record, won["shape"])
                runtime += f" on shape {won['shape']}"
        items.append({**art, "runtime": runtime,
                      "size_mb": entry.outputs[0].bytes / 1e6 if entry.outputs[0].bytes
                      else None, "sha256": entry.outputs[0].sha256, "flops": flops,
                      "flops_source": source, "rounds": []})
    return items


def shape_flops(stage_dir: Path, record: dict[str, Any], label: str | None
                ) -> tuple[float | None, str]:
    """FLOPs at 8 x 128 of a search shape's model, from its config.json."""
    shape = next((s for s in record.get("shapes") or [] if s.get("label") == label), None)
    if shape is None or "folder" not in shape:
        return None, "no FLOPs: the shape's folder is not recorded"
    path = stage_dir / "shapes" / shape["folder"] / "model" / "config.json"
    if not path.is_file():
        return None, f"no FLOPs: {path.name} missing"
    pruned = path.parent / STRUCTURE
    structure = json.loads(pruned.read_text()) if pruned.is_file() else None
    flops = forward_flops(json.loads(path.read_text()), structure=structure)
    note = f"FLOPs {flops / 1e9:.2f} G at {FLOPS_BATCH} x {SEQ_LEN} from the shape's config"
    if structure is not None:
        note += f" and its pruned shapes ({STRUCTURE})"
    return flops, note


def search_records(run_dir: Path, manifest: Manifest
                   ) -> Iterator[tuple[Any, Path, dict[str, Any]]]:
    """(stage entry, stage folder, search.json) of each finished search stage."""
    for entry in manifest.stages:
        record_path = run_dir / f"{entry.index:02d}-{entry.name}" / "search.json"
        if entry.kind == "search" and entry.finished_ok and record_path.is_file():
            yield entry, record_path.parent, json.loads(record_path.read_text())


def search_front_items(run_dir: Path, manifest: Manifest) -> list[dict[str, Any]]:
    """The trials on each search stage's accuracy-latency front (its `search.json`), other
    than the winner, which is the stage's own artifact: each named STAGE/TRIAL."""
    found = []
    for entry, stage_dir, record in search_records(run_dir, manifest):
        metric = record["metric"]
        ok = {t["id"]: t for t in record["trials"] if t.get("status") == "ok" and t.get(metric)}
        entering = flops_of(run_dir, manifest, entry.index)  # trials of the entering model
        front = pareto_front([(t[metric], t["accuracy"], tid) for tid, t in ok.items()])
        for _, _, tid in front:
            if tid == record.get("winner"):
                continue
            trial = ok[tid]
            folder = Path(trial["folder"]) / trial["export_dir"]
            file = run_dir / folder / trial["file"]
            flops, note = (shape_flops(stage_dir, record, trial["shape"])
                           if trial.get("shape") else entering)
            shape = f" on shape {trial['shape']}" if trial.get("shape") else ""
            found.append({"name": f"{entry.name}/{tid}", "kind": EXPORT_SPEC.kind,
                          "folder": str(folder), "index": entry.index,
                          "config": {"kind": EXPORT_SPEC.kind,
                                     "format": CANDIDATES[trial["candidate"]][1]},
                          "runtime": f"{CANDIDATES[trial['candidate']][0]}{shape} "
                                     f"(search front)",
                          "size_mb": file.stat().st_size / 1e6 if file.is_file() else None,
                          "sha256": trial.get("sha256"), "flops": flops,
                          "flops_source": note, "rounds": []})
    return found


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


def peer_items(run_dir: Path, manifest: Manifest, echo: Callable[[str], None]
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Build (or reuse) the peers' files: Optimum's fp32 and int8 of the fine-tuned model,
    Optimum's int8 of each student a search fine-tuned without a teacher, OpenVINO's int8
    of the fine-tuned model; their items and the environment's facts."""
    index, source, sha = peer_source(run_dir, manifest)
    venv = optimum.OPTIMUM.path()
    facts = ensure_venv(optimum.OPTIMUM, echo, venv)
    labels = list((manifest.labels or {}).get("names") or [])
    if not labels:
        config = json.loads((source / "config.json").read_text())
        id2label = config.get("id2label") or {}
        labels = [id2label[k] for k in sorted(id2label, key=int)]
    folders = optimum.build_peers(run_dir, source, sha, labels, venv, facts, echo)
    flops, note = flops_of(run_dir, manifest, index)
    note = note.replace("its own config", "the config of the model Optimum exported")
    items = [onnx_item(run_dir, f, f.name, PEER_LABELS[f.name], flops, note)
             for f in folders]
    for entry, stage_dir, record in search_records(run_dir, manifest):
        for shape in record.get("shapes") or []:
            model = stage_dir / "shapes" / str(shape.get("folder")) / "model"
            if ((shape.get("shape") or {}).get("teacher") is not False
                    or not (model / "config.json").is_file()
                    or (model / "structure.json").is_file()):
                continue  # distilled or pruned: not what a user fine-tunes by hand
            weights = sorted(model.glob("*.safetensors")) or sorted(model.glob("*.bin"))
            student = optimum.build_peers(
                run_dir, model, sha256_file(weights[0]), labels, venv, facts, echo,
                under=f"{optimum.PEERS_DIR}/{entry.name}-{shape['label']}")[1]
            s_flops, s_note = shape_flops(stage_dir, record, shape["label"])
            items.append(onnx_item(
                run_dir, student, f"{entry.name}/{shape['label']}/optimum_int8",
                f"{PEER_LABELS['optimum_int8']} of shape {shape['label']}, fine-tuned on "
                f"the labels alone", s_flops, s_note))
    items.append(openvino.openvino_item(run_dir, folders[0], sha, venv, flops, note, echo))
    return items, facts


def onnx_item(run_dir: Path, folder: Path, name: str, runtime: str, flops: float | None,
              note: str) -> dict[str, Any]:
    """A peer's ONNX folder as a table item, loaded as compress loads its own ONNX."""
    kind = EXPORT_SPEC.kind
    return {"name": name, "kind": kind, "folder": str(folder.relative_to(run_dir)),
            "config": {"kind": kind, "format": "onnx"}, "runtime": runtime,
            "size_mb": (folder / "model.onnx").stat().st_size / 1e6, "flops": flops,
            "flops_source": note, "peer": True, "rounds": []}

"""What benchmarks/classifier/peers.py times: a finished run's artifacts (and those of other
runs on the same model, `--with-run`), each with its runtime, size and FLOPs at 8 x 128, the
winner (the chain's result) marked; and the peers' files, built or reused (optimum.py,
openvino.py): Optimum's fp32 and its int8 at each `--optimize` level and OpenVINO's static
int8, of the teacher (the product ratio) and of the winner's own student weights, found
through the run's manifest (the like-for-like ratio)."""

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

PEER_LABELS = {optimum.FP32: "ONNX Runtime fp32 (Optimum)",
               optimum.INT8: f"ONNX Runtime int8 dynamic (Optimum {optimum.QUANTIZE_ISA})"}


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
    """The compress artifacts to time: name, folder, kind, config, label, size, FLOPs, and
    `winner` on the chain's result (`winner_index`)."""
    items, winner = [], winner_index(run_dir, manifest)
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
                      "flops_source": source, "winner": art["index"] == winner,
                      "rounds": []})
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
                              "run_dir": str(other), "winner": False})
    return found


def is_plain_folder(folder: Path) -> bool:
    """A Hugging Face model folder a peer can export as it is: a config.json, and neither a
    pruned model's structure.json nor a quantized model's model.pt2."""
    return ((folder / "config.json").is_file()
            and not any((folder / f).exists() for f in (STRUCTURE, "model.pt2")))


def winner_index(run_dir: Path, manifest: Manifest) -> int | None:
    """The stage whose artifact is the chain's result, the *winner* of the table's two
    ratios: the last finished search stage, else the last stage with an artifact."""
    searches = [entry.index for entry, _, _ in search_records(run_dir, manifest)]
    if searches:
        return searches[-1]
    found = artifacts_of(run_dir)
    return found[-1]["index"] if found else None


def student_source(run_dir: Path, manifest: Manifest) -> dict[str, Any]:
    """The float weights the winner was made from (`winner_index`), for the like-for-like
    peers: {"folder", "sha256", "label" (the peers' row prefix and folder), "how",
    "flops", "flops_source"}, or {"none": why} where there is no such Hugging Face folder
    apart from the teacher's. A search winner's are the model folder of the shape its trial
    was built on (`search.json`: the trial's `shape`, the shape's `folder`); any other
    winner's the nearest stage up its chain of producers (the manifest's input and output
    sha256) that saved a model folder."""
    index = winner_index(run_dir, manifest)
    if index is None:
        return {"none": "no stage made an artifact"}
    teacher = peer_source(run_dir, manifest)
    entry = manifest.stages[index]
    record_path = run_dir / f"{entry.index:02d}-{entry.name}" / "search.json"
    if entry.kind == "search" and record_path.is_file():
        record = json.loads(record_path.read_text())
        won = next((t for t in record["trials"] if t["id"] == record.get("winner")), None)
        if won is None:
            return {"none": f"{entry.name}: search.json names no winning trial"}
        if won.get("shape"):
            shape = next((s for s in record.get("shapes") or []
                          if s.get("label") == won["shape"]), {})
            folder = record_path.parent / "shapes" / str(shape.get("folder")) / "model"
            how = (f"{entry.name}'s winner {won['id']} was built on shape {won['shape']}: "
                   f"{folder.relative_to(run_dir)}")
            if not (folder / "config.json").is_file():
                return {"none": f"{how}, which is missing"}
            if not is_plain_folder(folder):
                return {"none": f"{how}, pruned (structure.json): no Hugging Face folder a "
                                "peer exports as it is"}
            weights = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
            flops, note = shape_flops(record_path.parent, record, won["shape"])
            return {"folder": folder, "sha256": sha256_file(weights[0]), "how": how,
                    "label": f"{entry.name}/{won['shape']}", "flops": flops,
                    "flops_source": note}
        step = producer(manifest, entry)  # the search's entering model
    else:
        step = entry
    while step is not None:
        output = step.outputs[0] if step.outputs else None
        if output is not None and output.model_dir:
            folder = run_dir / output.model_dir
            how = f"the winner ({entry.name}) was made from {step.name}'s {output.model_dir}"
            if (folder / STRUCTURE).is_file():
                return {"none": f"{how}, pruned (structure.json): no Hugging Face folder a "
                                "peer exports as it is"}
            if is_plain_folder(folder):
                if step.index == teacher[0]:
                    return {"none": f"{how}: the teacher's own weights, so the product "
                                    "ratio is the like-for-like one"}
                flops, note = flops_of(run_dir, manifest, step.index)
                return {"folder": folder, "sha256": output.sha256, "how": how,
                        "label": step.name, "flops": flops, "flops_source": note}
        step = producer(manifest, step)
    return {"none": f"the winner ({entry.name}) has no float Hugging Face folder up its chain"}


def labels_of(manifest: Manifest, source: Path) -> list[str]:
    """The label names, from the manifest or the model's config.json."""
    labels = list((manifest.labels or {}).get("names") or [])
    if not labels:
        config = json.loads((source / "config.json").read_text())
        id2label = config.get("id2label") or {}
        labels = [id2label[k] for k in sorted(id2label, key=int)]
    return labels


def peer_items(run_dir: Path, manifest: Manifest, echo: Callable[[str], None],
               levels: tuple[str, ...] | list[str] = optimum.LEVELS,
               failed: dict[str, str] | None = None
               ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Build (or reuse) the peers' files and their items: on the teacher (the fine-tuned
    model, the user's: the product ratio) Optimum's fp32, its dynamic int8 at each
    `--optimize` level and OpenVINO's static int8; on the winner's own student weights
    (`student_source`: the like-for-like ratio) Optimum's int8 at each level and OpenVINO's;
    Optimum's int8 at each level of every other student a search fine-tuned on the labels
    alone. Also the environment's facts and the student record (for the header). An
    Optimum level that cannot be built is left out and named in `failed` with its reason."""
    index, source, sha = peer_source(run_dir, manifest)
    venv = optimum.OPTIMUM.path()
    facts = ensure_venv(optimum.OPTIMUM, echo, venv)
    labels = labels_of(manifest, source)
    folders = optimum.build_peers(run_dir, source, sha, labels, venv, facts, echo,
                                  levels=levels, failed=failed)
    flops, note = flops_of(run_dir, manifest, index)
    note = note.replace("its own config", "the config of the model Optimum exported")
    items = [onnx_item(run_dir, folders[optimum.FP32], optimum.FP32, PEER_LABELS[optimum.FP32],
                       flops, note, peer_kind=optimum.FP32, peer_of="teacher")]
    items += level_items(run_dir, folders, "", "", flops, note, "teacher")
    items.append(openvino.openvino_item(run_dir, folders[optimum.FP32], sha, venv, flops,
                                        note, echo))
    student = student_source(run_dir, manifest)
    if "folder" in student:
        under = f"{optimum.PEERS_DIR}/{student['label'].replace('/', '-')}"
        made = optimum.build_peers(run_dir, student["folder"], student["sha256"], labels, venv,
                                   facts, echo, under=under, levels=levels, failed=failed)
        prefix = f"{student['label']}/"
        items += level_items(run_dir, made, prefix, " of the winner's student weights",
                             student["flops"], student["flops_source"], "student")
        items.append(openvino.openvino_item(
            run_dir, made[optimum.FP32], student["sha256"], venv, student["flops"],
            student["flops_source"], echo, under=under, name=f"{prefix}{openvino.NAME}",
            runtime=f"{openvino.LABEL} of the winner's student weights", peer_of="student"))
    for entry, stage_dir, record in search_records(run_dir, manifest):
        for shape in record.get("shapes") or []:
            model = stage_dir / "shapes" / str(shape.get("folder")) / "model"
            if ((shape.get("shape") or {}).get("teacher") is not False
                    or not is_plain_folder(model) or model == student.get("folder")):
                continue  # distilled, pruned, or the student's rows above
            weights = sorted(model.glob("*.safetensors")) or sorted(model.glob("*.bin"))
            made = optimum.build_peers(
                run_dir, model, sha256_file(weights[0]), labels, venv, facts, echo,
                under=f"{optimum.PEERS_DIR}/{entry.name}-{shape['label']}", levels=levels,
                failed=failed)
            s_flops, s_note = shape_flops(stage_dir, record, shape["label"])
            items += level_items(run_dir, made, f"{entry.name}/{shape['label']}/",
                                 f" of shape {shape['label']}, fine-tuned on the labels alone",
                                 s_flops, s_note, "labels alone")
    return items, facts, {k: (shown_path(v, run_dir) if isinstance(v, Path) else v)
                          for k, v in student.items()}


def level_items(run_dir: Path, folders: dict[str, Path], prefix: str, suffix: str,
                flops: float | None, note: str, peer_of: str) -> list[dict[str, Any]]:
    """An item per `--optimize` level's int8 folder of `folders`, named PREFIX +
    optimum_int8_LEVEL."""
    found = []
    for name, folder in folders.items():
        if name == optimum.FP32:
            continue
        level = name.removeprefix(f"{optimum.INT8}_")
        found.append(onnx_item(run_dir, folder, f"{prefix}{name}",
                               f"{PEER_LABELS[optimum.INT8]} --optimize {level}{suffix}",
                               flops, note, peer_kind=optimum.INT8, peer_of=peer_of,
                               level=level))
    return found


def shown_path(path: Path, run_dir: Path) -> str:
    """`path` relative to the run folder (no absolute path in a results file)."""
    try:
        return str(path.relative_to(run_dir))
    except ValueError:
        return path.name


def onnx_item(run_dir: Path, folder: Path, name: str, runtime: str, flops: float | None,
              note: str, **peer: Any) -> dict[str, Any]:
    """A peer's ONNX folder as a table item, loaded as compress loads its own ONNX; `peer`:
    its `peer_kind`, `peer_of` (teacher, student, labels alone) and `level`."""
    kind = EXPORT_SPEC.kind
    return {"name": name, "kind": kind, "folder": str(folder.relative_to(run_dir)),
            "config": {"kind": kind, "format": "onnx"}, "runtime": runtime,
            "size_mb": (folder / "model.onnx").stat().st_size / 1e6, "flops": flops,
            "flops_source": note, "peer": True, **peer, "rounds": []}

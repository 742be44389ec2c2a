"""The headline rows of run folders: ratios read from the manifests (no model runs),
and the fixed-width table `benchmarks/headline/run.py` prints.

What every row compares (all figures from one run folder, see `headline_rows`):

- latency × = the model's median latency / the reference's median latency at the largest
  batch size the recipe times (`latency_ms_bN`). When the reference is the model that
  entered the stage, both medians come from that stage's own process: `latency_ms_bN /
  input_latency_ms_bN` ("same process"). Otherwise the two stages' own medians are divided:
  `latency_ms_bN / reference latency_ms_bN` ("separate timings"). Below 1 is faster.
- Δ acc pt = 100 * (accuracy - reference accuracy); size × = size_mb / reference size_mb.
- Each measured stage is compared with the model that entered it, with the recipe's first
  fine-tuned model (the fp32 reference / teacher) when that is not its input, and, for an
  ONNX Runtime int8 export, with the fp32 ONNX export of the same model.
- A row is flagged noisy when a median it uses was marked noisy by the harness
  (`latency_noisy_batches`: p90 more than 25% above p50).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness.provenance import shown
from compress.measure.latency import NOISY_SPREAD  # also cross-checks input timings
from compress.recipe.registry import all_specs, spec_of
from compress.report.runtimes import producer, reference_index, runtime_label
from compress.runfolder.records import Manifest, StageRecord, read_manifest

SERVED_RECIPE = "bert_int8"


def largest_batch(manifest: Manifest) -> int | None:
    """The largest batch size the recipe times (evaluation.latency.batch_sizes)."""
    batches = manifest.latency_settings().get("batch_sizes") or []
    return max(batches) if batches else None


def _quantizing(entry: StageRecord) -> bool:
    """Whether the stage itself changes the precision of what it writes (an int8 export)."""
    return entry.kind in all_specs() and spec_of(entry.kind).precision_of(entry.config) is not None


def _float_sibling(entry: StageRecord, manifest: Manifest) -> StageRecord | None:
    """The float artifact of the same kind and format made from the same input as this
    precision-changing one (the fp32 ONNX export beside an ONNX Runtime int8 export)."""
    sha = entry.inputs[0].sha256 if entry.inputs else None
    for other in manifest.stages:
        if (other is not entry and other.kind == entry.kind and other.finished_ok
                and other.config.get("format") == entry.config.get("format")
                and not _quantizing(other)
                and (other.inputs[0].sha256 if other.inputs else None) == sha):
            return other
    return None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def compare(recipe: str, entry: StageRecord, reference: StageRecord, batch: int,
            same_process: bool, manifest: Manifest) -> dict[str, Any]:
    """One headline row: `entry`'s model against `reference`'s at batch `batch`.

    same_process: `reference` entered `entry`'s stage, so the denominator is the input median
    timed in that stage's process (`input_latency_ms_bN`); else the reference stage's own
    median (`latency_ms_bN`)."""
    m, r = entry.metrics, reference.metrics
    key = f"latency_ms_b{batch}"
    latency = m.get(key)
    ref_latency = m.get(f"input_{key}") if same_process else r.get(key)
    notes = []
    if batch in (m.get("latency_noisy_batches") or []):
        notes.append(f"noisy b{batch}")
    if not same_process and batch in (r.get("latency_noisy_batches") or []):
        notes.append(f"noisy b{batch} in {reference.name}")
    own = r.get(key)  # the input's median in its own stage: a cross-check of the input timing
    if same_process and ref_latency and own and abs(ref_latency - own) / own > NOISY_SPREAD:
        notes.append(f"noisy: input timed {ref_latency:.2f} ms here, {own:.2f} ms in "
                     f"{reference.name}")
    accuracy, ref_accuracy = m.get("accuracy"), r.get("accuracy")
    delta = (100 * (accuracy - ref_accuracy)
             if accuracy is not None and ref_accuracy is not None else None)
    row = {
        "recipe": recipe, "status": "ok",
        "path": f"{recipe}/{entry.name}", "stage": entry.name,
        "runtime": runtime_label(manifest, entry.index),
        "reference": reference.name, "reference_runtime": runtime_label(manifest, reference.index),
        "batch": batch, "latency_ms": latency, "reference_latency_ms": ref_latency,
        "latency_ratio": _ratio(latency, ref_latency),
        "timing": "same process" if same_process else "separate timings",
        "accuracy": accuracy, "reference_accuracy": ref_accuracy, "accuracy_delta_pt": delta,
        "size_mb": m.get("size_mb"), "reference_size_mb": r.get("size_mb"),
        "size_ratio": _ratio(m.get("size_mb"), r.get("size_mb")),
        "noisy": bool(notes), "notes": notes,
    }
    if latency is None or ref_latency is None:
        row["notes"].append(f"no b{batch} latency")
    row["notes"].append(row["timing"])
    return row


def recipe_rows(recipe: str, run_dir: str | Path) -> list[dict[str, Any]]:
    """The headline rows of one run folder (see the module docstring for what is compared);
    one row with status "missing" when the folder has no readable manifest."""
    manifest = read_manifest(run_dir)
    if manifest is None:
        return [{"recipe": recipe, "status": "missing", "path": f"{recipe}/-",
                 "run_dir": shown(run_dir),
                 "notes": [f"no readable manifest.json in {shown(run_dir)}"]}]
    batch = largest_batch(manifest)
    index = reference_index(manifest)
    reference = manifest.stages[index] if index is not None else None
    rows: list[dict[str, Any]] = []
    for entry in manifest.stages:
        known = entry.kind in all_specs()
        if entry is reference or (known and not spec_of(entry.kind).measured):
            continue
        if not entry.finished_ok:
            rows.append({"recipe": recipe, "status": entry.status or "unknown",
                         "path": f"{recipe}/{entry.name}", "stage": entry.name,
                         "run_dir": shown(run_dir),
                         "notes": [entry.error or f"stage {entry.status}"]})
            continue
        if batch is None or f"latency_ms_b{batch}" not in entry.metrics:
            continue  # not a measured model
        made_by = producer(manifest, entry)
        pairs: list[tuple[StageRecord, bool]] = []
        if made_by is not None and made_by.finished_ok:
            pairs.append((made_by, True))
        if reference is not None and reference is not made_by:
            pairs.append((reference, False))
        sibling = _float_sibling(entry, manifest) if _quantizing(entry) else None
        if sibling is not None and sibling is not made_by:
            pairs.append((sibling, False))
        for other, same in pairs:
            row = compare(recipe, entry, other, batch, same, manifest)
            row["run_dir"] = shown(run_dir)
            rows.append(row)
    return rows


def headline_rows(run_dirs: dict[str, Path]) -> list[dict[str, Any]]:
    """Every headline row of every run folder ({recipe name: run folder}), in that order."""
    rows: list[dict[str, Any]] = []
    for recipe, run_dir in run_dirs.items():
        rows += recipe_rows(recipe, run_dir)
    return rows


def hardware(run_dirs: dict[str, Path]) -> list[dict[str, Any]]:
    """The distinct environments (CPU model, cores, threads, libraries) of the manifests."""
    seen: list[dict[str, Any]] = []
    for recipe, run_dir in run_dirs.items():
        manifest = read_manifest(run_dir)
        if manifest is None:
            continue
        env = manifest.environment
        cpu = env.get("cpu") or {}
        libs = env.get("libraries") or {}
        item = {"cpu": cpu.get("model"), "cores": cpu.get("cores"),
                "threads": env.get("threads"),
                "isa": [flag for flag, on in (cpu.get("isa") or {}).items() if on],
                "libraries": {k: libs[k] for k in ("torch", "torchao", "onnxruntime")
                              if k in libs}}
        machine = ("cpu", "cores", "threads", "isa")
        same = next((s for s in seen if all(s[k] == item[k] for k in machine)), None)
        if same:
            same["recipes"].append(recipe)
            same["libraries"].update(item["libraries"])
        else:
            seen.append({**item, "recipes": [recipe]})
    return seen


def served_figures(result: dict[str, Any] | None) -> dict[str, Any] | None:
    """Throughput at the highest / the lowest concurrency and the mean batch size at the
    highest, from a `compress.serving.loadtest.predictions.sweep` result (or
    loadtest.json); None without runs."""
    runs = (result or {}).get("runs") or []
    if not runs:
        return None
    high = max(runs, key=lambda r: r["concurrency"])
    low = min(runs, key=lambda r: r["concurrency"])
    return {"high_concurrency": high["concurrency"], "low_concurrency": low["concurrency"],
            "throughput_rps_high": high.get("throughput_rps"),
            "throughput_rps_low": low.get("throughput_rps"),
            "throughput_ratio": _ratio(high.get("throughput_rps"), low.get("throughput_rps")),
            "batch_size_mean_high": high.get("batch_size_mean"),
            "batch_size_max_high": high.get("batch_size_max"),
            "latency_ms_p50_low": low.get("latency_ms_p50"),
            "latency_ms_p50_high": high.get("latency_ms_p50"),
            "errors": sum(r.get("errors") or 0 for r in runs),
            "requests_per_level": high.get("requests"),
            "server_settings": (result or {}).get("server_settings"),
            "measured": (result or {}).get("measured")}


# ---------------------------------------------------------------------------------------------
# Presentation


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(rows: list[dict[str, Any]], hw: list[dict[str, Any]],
           served: dict[str, Any] | None = None, served_error: str | None = None,
           failures: list[str] | None = None) -> str:
    """The plain fixed-width report: hardware, the table, the served line, failures."""
    lines = []
    for item in hw:
        libs = ", ".join(f"{k} {v}" for k, v in item["libraries"].items())
        lines.append(f"hardware: CPU {item['cpu']}, {item['cores']} cores, {item['threads']} "
                     f"threads, ISA {' '.join(item['isa']) or '-'}; {libs} "
                     f"({', '.join(item['recipes'])})")
    batches = sorted({r["batch"] for r in rows if r.get("batch") is not None})
    if batches:
        shown = ", ".join(f"b{b}" for b in batches)
        lines.append(f"latency × = model median / reference median at the largest timed "
                     f"batch ({shown}); below 1 is faster. Δ acc in points, size × = MB / "
                     f"reference MB.")
    head = ["path", "compared", "latency ×", "ms model / ref", "Δ acc pt", "size ×", "notes"]
    table = []
    for r in rows:
        if r.get("status") != "ok":
            table.append([r["path"], r["status"].upper(), "-", "-", "-", "-",
                          "; ".join(r.get("notes") or [])])
            continue
        ms = f"{_num(r['latency_ms'], 2)} / {_num(r['reference_latency_ms'], 2)}"
        table.append([r["path"],
                      f"{r['runtime']} vs {r['reference']} ({r['reference_runtime']})",
                      _num(r["latency_ratio"], 3), ms, _num(r["accuracy_delta_pt"], 2),
                      _num(r["size_ratio"], 3), "; ".join(r["notes"])])
    if table:
        widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(head)]
        right = {2, 3, 4, 5}

        def fmt(cells: list[str]) -> str:
            return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(cells, widths, strict=True))
                             ).rstrip()

        lines += ["", fmt(head), fmt(["-" * w for w in widths])]
        lines += [fmt(row) for row in table]
    lines.append("")
    if served:
        settings = served.get("server_settings") or {}
        setup = (f"batch {settings.get('batchSize')}, delay {settings.get('maxBatchDelay')} ms, "
                 f"{settings.get('maxWorkers')} worker x {settings.get('threads_per_worker')} "
                 f"threads" if settings else "")
        lines.append(
            f"served {SERVED_RECIPE} (TorchServe{', ' + setup if setup else ''}): throughput "
            f"c{served['high_concurrency']} / c{served['low_concurrency']} = "
            f"{_num(served['throughput_ratio'], 2)}x ({_num(served['throughput_rps_high'], 1)}"
            f" / {_num(served['throughput_rps_low'], 1)} req/s), mean batch at "
            f"c{served['high_concurrency']} {_num(served['batch_size_mean_high'], 2)} "
            f"(max {served['batch_size_max_high']}), p50 "
            f"{_num(served['latency_ms_p50_low'], 1)} / "
            f"{_num(served['latency_ms_p50_high'], 1)} ms, {served['errors']} errors, "
            f"{served['requests_per_level']} requests per level")
    elif served_error:
        lines.append(f"served {SERVED_RECIPE}: FAILED: {served_error}")
    for failure in failures or []:
        lines.append(failure)
    return "\n".join(lines).rstrip() + "\n"



"""Latency of every artifact of a finished run, each timed in its own fresh Python process.

In the pipeline, every model is timed in the process that made it, after training and
other models have run there: allocator state, thread pools and compiled caches carry
over. Here each artifact gets a new interpreter (`python -m compress.report.rebench SPEC`)
that loads it, times it with the recipe's latency harness and prints one JSON line;
the figures land in `<run>/bench.json`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compress.errors import UserError, one_line
from compress.recipe.registry import all_specs, import_function, spec_of
from compress.runfolder.files import atomic_write_json, now, run_lock
from compress.runfolder.records import require_manifest

BENCH = "bench.json"


# --------------------------------------------------------------------------- the parent


def artifacts_of(run_dir: Path) -> list[dict[str, Any]]:
    """The loadable artifacts of a run, in stage order: the first output of each finished
    stage whose kind is measured and that saved a model (`model_dir`) or an export
    (`export_dir`).

    Each is {"name", "kind", "folder" (relative to the run), "index", "config"}. The
    baseline (never saved) and unmeasured kinds (a .mar is not a model) are left out. A
    stage name shared by several stages (unnamed stages of one kind) gets `#index`."""
    manifest = require_manifest(Path(run_dir))
    found = []
    for i, entry in enumerate(manifest.stages):
        known = entry.kind in all_specs()
        if not entry.finished_ok or not known or not spec_of(entry.kind).measured:
            continue
        output = entry.outputs[0] if entry.outputs else None
        folder = output and (output.model_dir or output.export_dir)
        if folder:
            found.append({"name": entry.name or entry.kind or str(i), "kind": entry.kind,
                          "index": entry.index, "folder": folder, "config": entry.config})
    names = [a["name"] for a in found]
    for artifact in found:
        if names.count(artifact["name"]) > 1:
            artifact["name"] = f"{artifact['name']}#{artifact['index']}"
    return found


def bench_fresh(run_dir: Path | str, names: list[str] | None = None, iters: int | None = None,
                warmup: int | None = None, threads: int | None = None,
                echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Time the selected artifacts (default: all) of `run_dir`, each in a new process, with
    the run's latency settings (`iters`, `warmup`, `threads` override them); write and
    return `<run_dir>/bench.json` (with `names`, the other artifacts' earlier figures are
    kept; each artifact records when and how it was timed). An artifact whose process
    fails gets {"error": line}.

    `names` are artifact names (see `artifacts_of`) or stage indexes. Raises UserError for
    an unknown name, a run without artifacts, bad overrides or a run in progress."""
    run_dir = Path(run_dir)
    available = artifacts_of(run_dir)
    if not available:
        raise UserError(f"{run_dir}: no finished stage saved a model or an export to time "
                        f"(run the recipe first: compress run RECIPE)")
    chosen = select_artifacts(available, names)
    latency = latency_settings(run_dir, iters, warmup, threads)
    kept = {}
    if names and (run_dir / BENCH).is_file():  # timing some artifacts keeps the others'
        with contextlib.suppress(ValueError, OSError):
            kept = json.loads((run_dir / BENCH).read_text()).get("artifacts") or {}
    result: dict[str, Any] = {"measured": now(), "fresh_process": True,
                              "settings": latency, "artifacts": dict(kept),
                              "timed": [a["name"] for a in chosen]}
    with run_lock(run_dir, "a compress run is using this folder; bench it when the run "
                  "has finished"):
        for artifact in chosen:
            echo(f"bench: {artifact['name']} ({artifact['folder']}) in a fresh process")
            metrics = _run_child(run_dir, artifact, latency, threads)
            metrics.update(measured=now(), settings=latency)
            result["artifacts"][artifact["name"]] = metrics
            echo(f"bench: {artifact['name']}: " + (
                f"failed: {metrics['error']}" if "error" in metrics else _summary(metrics)))
        atomic_write_json(run_dir / BENCH, result)
    return result


def select_artifacts(available: list[dict[str, Any]], names: list[str] | None
                     ) -> list[dict[str, Any]]:
    """The artifacts `names` picks (by name, stage name or stage index), in stage order."""
    if not names:
        return available
    picked: set[int] = set()
    unknown = []
    for name in names:
        hits = [i for i, a in enumerate(available)
                if name in (a["name"], a["name"].split("#")[0], str(a["index"]))]
        if not hits:
            unknown.append(name)
        picked.update(hits)
    if unknown:
        choices = ", ".join(a["name"] for a in available)
        raise UserError(f"no artifact named {', '.join(unknown)} in this run "
                        f"(choices: {choices})")
    return [a for i, a in enumerate(available) if i in picked]


def latency_settings(run_dir: Path, iters: int | None, warmup: int | None,
              threads: int | None) -> dict[str, Any]:
    """The run's `evaluation.latency` (manifest, else recipe.yaml) with the overrides."""
    from pydantic import ValidationError

    from compress.recipe.schema import LatencyConfig, read_yaml

    recipe = require_manifest(run_dir).recipe
    if not recipe and (run_dir / "recipe.yaml").is_file():
        recipe = read_yaml(run_dir / "recipe.yaml")
    raw = dict(((recipe or {}).get("evaluation") or {}).get("latency") or {})
    overrides = {"iters": iters, "warmup": warmup, "threads": threads}
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        lat = LatencyConfig.model_validate(raw)
    except ValidationError as exc:
        raise UserError([f"{'.'.join(map(str, e['loc'])) or 'latency'}: {e['msg']}"
                         for e in exc.errors()]) from None
    settings = lat.model_dump(mode="json")
    settings.pop("enabled", None)  # asked for explicitly: timed even when off in the recipe
    settings.setdefault("seq_lens", None)
    return settings


def _run_child(run_dir: Path, artifact: dict[str, Any], latency: dict[str, Any],
               threads: int | None) -> dict[str, Any]:
    """Metrics printed by one child process, or {"error": one line}."""
    spec = {"run_dir": str(run_dir.resolve()), "folder": artifact["folder"],
            "kind": artifact["kind"],
            "config": artifact["config"], "latency": latency,
            "threads_override": threads,
            "sys_path": [p for p in sys.path if p]}
    return run_json_child([sys.executable, "-m", "compress.report.rebench", json.dumps(spec)])


def run_json_child(command: list[str]) -> dict[str, Any]:
    """The JSON line a child process printed last (see `child_main`), or {"error": one
    line}: its own error, else the last line of its stderr and its exit code."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        return {"error": f"cannot start {command[0]}: {exc}"}
    answer = _last_json_line(done.stdout)
    if answer is not None and "error" not in answer and done.returncode == 0:
        return answer
    if answer is not None and answer.get("error"):
        return {"error": str(answer["error"])}
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    cause = lines[-1].strip() if lines else "no output"
    return {"error": f"the process exited with code {done.returncode}: {cause}"}


def _last_json_line(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def _summary(metrics: dict[str, Any]) -> str:
    keys = [k for k in metrics if re.fullmatch(r"latency_ms_b\d+", k)]
    return ", ".join(f"{k} {metrics[k]}" for k in keys) or "no latency figures"


# --------------------------------------------------------------------------- the child


def load_artifact(run_dir: Path, folder: str, kind: str, config: dict[str, Any],
                  threads: int | None = None, override: int | None = None) -> Any:
    """The artifact as a bundle, ready to run as the pipeline timed it: the kind's own
    `reload` (int8 models compiled with freezing, compiled models compiled with the stage's
    options, exports in their runtime with `override`, the stage's or `threads` threads),
    else the saved model as it is. Compiled models get their first, compiling call here."""
    from compress.algorithms.quantization import warm_up
    from compress.models.folders import load_saved

    path = run_dir / folder
    if not path.is_dir():
        raise FileNotFoundError(f"artifact folder {folder} is missing from {run_dir}")
    reload = spec_of(kind).reload
    if reload is not None:
        return import_function(reload)(path, config, threads, override)
    bundle = load_saved(path)
    if getattr(bundle.model, "compiled", None) is not None:  # an int8 model, compiled
        warm_up(bundle.model.eval(), bundle)
    return bundle


def load_for_child(spec: dict[str, Any]) -> tuple[Any, Any, float]:
    """A child's artifact from its spec: (bundle, LatencyConfig, seconds the load took),
    after the parent's `sys_path` entries are added (e.g. a `module:factory` model's)."""
    from compress.recipe.schema import LatencyConfig

    for entry in spec.get("sys_path") or []:
        if entry not in sys.path:
            sys.path.append(entry)
    lat = LatencyConfig.model_validate(spec["latency"])
    began = time.perf_counter()
    bundle = load_artifact(Path(spec["run_dir"]), spec["folder"], spec["kind"],
                           spec.get("config") or {}, lat.threads, spec.get("threads_override"))
    return bundle, lat, round(time.perf_counter() - began, 3)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Load one artifact and time it; the figures, with `pid` and `load_s`."""
    from compress.measure.figures import latency_sweep

    bundle, lat, load_s = load_for_child(spec)
    metrics = latency_sweep(bundle, lat)
    return {**metrics, "load_s": load_s, "folder": spec["folder"], "pid": os.getpid()}


def child_main(handle: Callable[[dict[str, Any]], dict[str, Any]],
               argv: list[str] | None = None) -> int:
    """A child process's entry: `handle(SPEC_JSON)` with stdout sent to stderr, then one
    JSON line on stdout (its figures, or {"error": one line} and exit code 1)."""
    argv = sys.argv[1:] if argv is None else argv
    out = sys.stdout
    try:
        spec = json.loads(argv[0])
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the answer only
            answer = handle(spec)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as one line
        import traceback

        traceback.print_exc(file=sys.stderr)
        print(json.dumps({"error": one_line(exc), "pid": os.getpid()}), file=out, flush=True)
        return 1
    print(json.dumps(answer), file=out, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m compress.report.rebench SPEC_JSON`: print one JSON line (figures or error)."""
    return child_main(child, argv)


if __name__ == "__main__":
    sys.exit(main())

"""The run loop: validate, find sources, load data, then baseline and stages with caching.

The manifest is the truth about a run folder. It is rewritten atomically after every
change, a stage is marked done only once its outputs are on disk, and a stage whose
config and input artifact are unchanged is reported as cached instead of run again.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from compress import distributed
from compress.errors import StageError, UserError
from compress.fingerprint import data_fingerprint, model_fingerprint
from compress.recipe import Recipe, export_stage_index, model_stage_index
from compress.runfolder import (
    MANIFEST,
    artifact_intact,
    atomic_write_json,
    atomic_write_text,
    environment,
    now,
    read_manifest,
    run_lock,
    sha256_file,
    sha256_json,
)
from compress.sources import check_recipe_sources
from compress.stages.configs import LEAF_KINDS, STAGE_RUNNERS

DONE = ("done", "cached")


def log(message: str) -> None:
    """Progress lines go to stderr; stdout is kept for results."""
    print(message, file=sys.stderr, flush=True)


def run_recipe(recipe: Recipe, *, force: bool = False, from_stage: str | int | None = None,
               echo: Callable[[str], None] = log) -> Path:
    """Run a validated recipe; return its run folder. Raises UserError or StageError."""
    from compress.data import load_data  # torch is imported from here on

    model_src, data_src = check_recipe_sources(recipe)
    first_forced = _first_forced(recipe, force, from_stage)
    data = load_data(recipe, data_src)
    base_key = sha256_json([model_fingerprint(recipe.model, model_src),
                            data_fingerprint(recipe, data_src),
                            recipe.evaluation.model_dump(mode="json"), recipe.seed])
    run_dir = Path(recipe.output_dir) / recipe.name
    if distributed.init() and not distributed.is_main():
        _follow(recipe, run_dir, data, model_src)
        distributed.shutdown()  # leave the group cleanly (no C++ abort at exit)
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    with run_lock(run_dir, "another compress run is using this folder"):
        runner = _Runner(recipe, run_dir, data, model_src, echo)
        runner.start()
        try:
            runner.baseline(base_key, force=first_forced == 0 and force)
            runner.stages(base_key, first_forced)
        finally:
            _write_reports(run_dir, echo)
    distributed.broadcast(("end",))  # the other ranks may leave
    distributed.shutdown()
    return run_dir


def _follow(recipe: Recipe, run_dir: Path, data, model_src) -> None:
    """A rank other than 0: train each data-parallel stage rank 0 announces, with the
    same input model, key and seed; write nothing (rank 0 owns the run folder)."""
    from compress.state import StageContext

    runner = _Runner(recipe, run_dir, data, model_src, echo=lambda _: None)
    while True:
        message = distributed.broadcast()
        if message[0] == "end":
            return
        _, i, key = message
        cfg = recipe.stages[i]
        runner.manifest = read_manifest(run_dir) or {}
        runner._use_model_of(model_stage_index(recipe, i))
        ctx = StageContext(i, cfg.name or cfg.kind, run_dir / f"{i:02d}-{cfg.kind}", run_dir,
                           recipe, data, key, _stage_seed(cfg, recipe), log=lambda _: None)
        try:
            _runner_for(cfg.kind)(runner.current(), cfg, ctx)
        except (StageError, UserError):
            raise
        except Exception as exc:
            cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise StageError(ctx.name, f"rank {distributed.rank()}: {cause}") from None
        runner.state, runner.model_index = None, -1  # the next stage reloads from disk


def _stage_seed(cfg, recipe: Recipe) -> int:
    return cfg.seed if getattr(cfg, "seed", None) is not None else recipe.seed


def _write_reports(run_dir: Path, echo: Callable[[str], None]) -> None:
    """report.json, report.md and report.png after every run, finished or not; a report
    that cannot be written is a warning, never the run's error."""
    from compress.report import write_reports

    try:
        written = write_reports(run_dir)
    except Exception as exc:  # noqa: BLE001 - the run's own outcome must not be masked
        echo(f"warning: the report could not be written: {type(exc).__name__}: {exc}")
        return
    echo("report: " + ", ".join(str(p.relative_to(run_dir)) for p in written)
         + f" in {run_dir} (compress report {run_dir})")


def _first_forced(recipe: Recipe, force: bool, from_stage: str | int | None) -> int:
    """Index of the first stage to run regardless of the cache (len(stages): none)."""
    if force:
        return 0
    if from_stage is None:
        return len(recipe.stages)
    text = str(from_stage)
    if text.isdigit():
        if int(text) >= len(recipe.stages):
            raise UserError(f"--from-stage {text}: the recipe has {len(recipe.stages)} stages")
        return int(text)
    for i, stage in enumerate(recipe.stages):
        if text in (stage.kind, stage.name):
            return i
    kinds = ", ".join(s.name or s.kind for s in recipe.stages)
    raise UserError(f"--from-stage {text}: no such stage (stages: {kinds})")


class _Runner:
    """Holds the manifest and the lazily loaded current model of one run."""

    def __init__(self, recipe: Recipe, run_dir: Path, data, model_src, echo):
        self.recipe, self.run_dir, self.data, self.model_src = recipe, run_dir, data, model_src
        self.echo = echo
        self.manifest: dict[str, Any] = {}
        self.state = None
        self.pending: dict[str, Any] | None = None  # outputs to load before the next stage runs
        self.model_index: int | None = None  # the stage whose model `current()` gives

    def start(self) -> None:
        old = read_manifest(self.run_dir) or {}
        self.manifest = {
            "name": self.recipe.name,
            "created": old.get("created", now()),
            "updated": now(),
            "recipe": self.recipe.model_dump(mode="json"),
            "environment": environment(),
            "labels": {"names": self.data.label_names, "mapping": self.data.label_mapping},
            "data": {name: len(ex) for name, ex in self.data.splits.items()},
            "baseline": old.get("baseline"),
            "stages": old.get("stages", []),
        }
        text = yaml.safe_dump(self.recipe.model_dump(mode="json"), sort_keys=False)
        atomic_write_text(self.run_dir / "recipe.yaml", text)
        self.save()

    def save(self) -> None:
        self.manifest["updated"] = now()
        atomic_write_json(self.run_dir / MANIFEST, self.manifest)

    def current(self):
        """The model entering the next stage, loaded on first need."""
        from compress.models import load_model, load_saved
        from compress.state import State

        if self.state is None:
            if self.pending is None:
                import torch

                torch.manual_seed(self.recipe.seed)  # new heads and factory models init alike
                cfg = self.recipe.model
                bundle = load_model(self.model_src, self.data.label_names, self.data.input_shape,
                                    cfg.checkpoint, cfg.kwargs, cfg.num_labels)
                self.state = State(bundle)
            else:
                folder = self.run_dir / self.pending["outputs"][0]["model_dir"]
                self.state = State(load_saved(folder), list(self.pending["outputs"]))
        return self.state

    def baseline(self, key: str, force: bool) -> None:
        if not self.recipe.evaluation.baseline:
            return
        old = self.manifest.get("baseline") or {}
        if not force and old.get("key") == key and old.get("status") in DONE:
            self.manifest["baseline"] = {**old, "status": "cached"}
            self.echo("baseline: cached")
            self.save()
            return
        from compress.measure import measure
        from compress.models import state_bytes

        self.echo("baseline: measuring the model before any stage")
        began = time.perf_counter()
        bundle = self.current().bundle
        metrics = measure(bundle, self.data, self.recipe)
        metrics["size_mb"] = round(state_bytes(bundle.model) / 1e6, 3)
        self.manifest["baseline"] = {"status": "done", "key": key, "metrics": metrics,
                                     "wall_time_s": round(time.perf_counter() - began, 2)}
        self.save()
        self.echo(f"baseline: {_summary(metrics)}")

    def stages(self, base_key: str, first_forced: int) -> None:
        entries = self.manifest["stages"]
        model_sha: dict[int, str] = {}  # stage index -> sha256 of the model it made
        total = len(self.recipe.stages)
        for i, cfg in enumerate(self.recipe.stages):
            name = cfg.name or cfg.kind
            if cfg.kind == "package":  # archives an export's file, needs no model
                source = export_stage_index(self.recipe, i)
                input_sha = entries[source]["outputs"][0]["sha256"]
            else:
                source = model_stage_index(self.recipe, i)
                input_sha = base_key if source is None else model_sha[source]
                self._use_model_of(source)
            config = cfg.model_dump(mode="json")
            parts = [config, input_sha, self.manifest["recipe"]["data"],
                     self.manifest["recipe"]["evaluation"], self.recipe.seed]
            key = sha256_json(parts + _code_digests(cfg))
            old = entries[i] if i < len(entries) else None
            tag = f"[{i + 1}/{total}] {name}"
            leaf = cfg.kind in LEAF_KINDS
            if i < first_forced and self._reusable(old, key):
                old["status"] = "cached"
                if not leaf:
                    self.pending, self.state, self.model_index = old, None, i
                self.echo(f"{tag}: cached")
            else:
                old = self._run_stage(i, cfg, name, config, key, input_sha, source)
                self.echo(f"{tag}: done in {old['wall_time_s']:.1f} s: {_summary(old['metrics'])}")
            if i < len(entries):
                entries[i] = old
            else:
                entries.append(old)
            self.save()
            if not leaf:
                model_sha[i] = old["outputs"][0]["sha256"]
        del entries[total:]
        self.save()

    def _use_model_of(self, index: int | None) -> None:
        """Make `current()` the model made by stage `index` (None: the recipe's model)."""
        if index != self.model_index:
            self.pending = None if index is None else self.manifest["stages"][index]
            self.state, self.model_index = None, index

    def _reusable(self, entry: dict | None, key: str) -> bool:
        return bool(entry and entry.get("key") == key and entry.get("status") in DONE
                    and entry.get("outputs")
                    and all(artifact_intact(o, self.run_dir) for o in entry["outputs"]))

    def _run_stage(self, i: int, cfg, name: str, config: dict, key: str, input_sha: str,
                   source: int | None) -> dict[str, Any]:
        from compress.measure import compare_to_input, latency_of, measure
        from compress.state import StageContext, State

        folder = self.run_dir / f"{i:02d}-{cfg.kind}"
        folder.mkdir(exist_ok=True)
        measured = getattr(cfg, "measured", True)
        if cfg.kind == "package":
            state = State(None, list(self.manifest["stages"][source]["outputs"]))
        else:
            state = self.current()
        entry = {"index": i, "name": name, "kind": cfg.kind, "status": "running",
                 "key": key, "config": config, "started": now(),
                 "inputs": list(state.artifacts) or [{"sha256": input_sha, "format": "source"}],
                 "outputs": [], "metrics": {}, "wall_time_s": None}
        entries = self.manifest["stages"]
        entries[i:i + 1] = [entry]
        self.save()
        ctx = StageContext(i, name, folder, self.run_dir, self.recipe, self.data, key,
                           _stage_seed(cfg, self.recipe), log=self.echo)
        parallel = cfg.kind in distributed.PARALLEL_KINDS and distributed.active()
        began = time.perf_counter()
        try:
            with distributed.solo():
                # the input model is timed again here so every ratio compares two models
                # timed in one process (a cached earlier stage's may come from another run)
                input_latency = (latency_of(state.bundle, self.recipe)
                                 if measured and self.recipe.evaluation.latency.enabled else {})
            if parallel:  # the other ranks load the same input model and join the training
                distributed.broadcast(("train", i, key))
            with contextlib.nullcontext() if parallel else distributed.solo():
                new_state = _runner_for(cfg.kind)(state, cfg, ctx)
            metrics = {}
            if measured:
                with distributed.solo():
                    metrics = measure(new_state.bundle, self.data, self.recipe,
                                      known=ctx.metrics)
                metrics.update(compare_to_input(metrics, input_latency,
                                                self._accuracy_of(source)))
        except KeyboardInterrupt:
            self._fail(entry, "interrupted; re-run the same command to resume", began)
            raise
        except (StageError, UserError) as exc:
            entry["metrics"] = dict(ctx.metrics)  # what the stage measured before failing
            self._fail(entry, str(exc), began)
            raise StageError(name, "; ".join(getattr(exc, "messages", [exc.cause]))) from None
        except Exception as exc:
            (folder / "error.log").write_text(traceback.format_exc())
            cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._fail(entry, cause, began)
            raise StageError(name, f"{cause} (traceback in {folder / 'error.log'})") from None
        if ctx.outputs:
            metrics["size_mb"] = round(ctx.outputs[0]["bytes"] / 1e6, 3)
        metrics.update(ctx.metrics)
        new_state.artifacts = list(ctx.outputs)
        entry.update(status="done", outputs=ctx.outputs, metrics=metrics, finished=now(),
                     wall_time_s=round(time.perf_counter() - began, 2))
        if cfg.kind not in LEAF_KINDS:
            self.state, self.pending, self.model_index = new_state, None, i
        shutil.rmtree(ctx.checkpoint_dir, ignore_errors=True)
        return entry

    def _accuracy_of(self, index: int | None) -> float | None:
        """Accuracy of the model made by stage `index` (None: the baseline), if measured."""
        entry = self.manifest.get("baseline") if index is None else self.manifest["stages"][index]
        return ((entry or {}).get("metrics") or {}).get("accuracy")

    def _fail(self, entry: dict, cause: str, began: float) -> None:
        entry.update(status="failed", error=cause, finished=now(),
                     wall_time_s=round(time.perf_counter() - began, 2))
        self.save()


def _runner_for(kind: str):
    module, func = STAGE_RUNNERS[kind].split(":")
    return getattr(importlib.import_module(module), func)


def _code_digests(cfg) -> list[str]:
    """sha256 of the source of the modules a stage ships in its output (`code_modules`),
    found without importing them: changed code invalidates the cached output."""
    digests = []
    for name in getattr(cfg, "code_modules", ()):
        spec = importlib.util.find_spec(name)
        digests.append(sha256_file(Path(spec.origin)))
    return digests


def _summary(metrics: dict[str, Any]) -> str:
    parts = []
    for key in ("accuracy", "accuracy_delta_vs_input", "macro_f1", "latency_ms_b1",
                "latency_ms_b8", "latency_ratio_b8", "size_mb", "sparsity"):
        if key in metrics:
            parts.append(f"{key} {metrics[key]}")
    return ", ".join(parts)

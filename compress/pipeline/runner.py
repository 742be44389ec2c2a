"""`Runner`: the manifest and the lazily loaded current model of one run, and running one
stage (timing its input, running it, measuring its output, recording it)."""

from __future__ import annotations

import contextlib
import shutil
import time
import traceback
from pathlib import Path
from typing import Any

import yaml

from compress.distributed import process_group
from compress.errors import CompressError, StageError, UserError, one_line
from compress.recipe.chain import input_stage_index
from compress.recipe.family_specs import FAMILIES, runner_of
from compress.recipe.registry import import_function, spec_of
from compress.runfolder.code_digest import code_digests, shipped_digests
from compress.runfolder.files import atomic_write_text, environment, now, sha256_json
from compress.runfolder.records import (
    FINISHED,
    Artifact,
    Baseline,
    Manifest,
    StageRecord,
    artifact_intact,
    read_manifest,
    write_manifest,
)


class Runner:
    """Holds the manifest and the lazily loaded current model of one run."""

    def __init__(self, recipe, run_dir: Path, data, model_src, echo,
                 task: str = "classification"):
        from compress.recipe.family_specs import functions

        self.recipe, self.run_dir, self.data, self.model_src = recipe, run_dir, data, model_src
        self.echo, self.task, self.family = echo, task, functions(task)
        self.manifest = Manifest(name=recipe.name)
        self.state = None
        self.pending: StageRecord | None = None  # its outputs load before the next stage
        self.model_index: int | None = None  # the stage whose model `current()` gives

    def start(self) -> None:
        old = read_manifest(self.run_dir)
        self.manifest = Manifest(
            name=self.recipe.name,
            created=old.created if old and old.created else now(),
            updated=now(),
            recipe=self.recipe.model_dump(mode="json"),
            environment=environment(),
            labels={"names": self.data.label_names, "mapping": self.data.label_mapping},
            data={name: len(ex) for name, ex in self.data.splits.items()},
            model=(old.model if old and old.model else {"task": self.task}),
            baseline=old.baseline if old else None,
            stages=old.stages if old else [],
        )
        # the recipe as given (after overrides): it loads back with `load_recipe`, where
        # defaults written out would read as options set for a format they do not fit
        text = yaml.safe_dump(self.recipe.model_dump(mode="json", exclude_unset=True),
                              sort_keys=False)
        atomic_write_text(self.run_dir / "recipe.yaml", text)
        self.save()

    def save(self) -> None:
        self.manifest.updated = now()
        write_manifest(self.run_dir, self.manifest)

    def current(self):
        """The model entering the next stage, loaded on first need."""
        from compress.models.folders import load_saved
        from compress.stages.context import State

        if self.state is None:
            if self.pending is None:
                bundle = self.family.load_model(self.recipe, self.model_src, self.data)
                self.manifest.model = {"task": self.task, **self.family.provenance(bundle)}
                self.state = State(bundle)
            else:
                folder = self.run_dir / self.pending.outputs[0].model_dir
                self.state = State(load_saved(folder), list(self.pending.outputs))
        return self.state

    def use_model_of(self, index: int | None) -> None:
        """Make `current()` the model made by stage `index` (None: the recipe's model)."""
        if index != self.model_index:
            self.pending = None if index is None else self.manifest.stages[index]
            self.state, self.model_index = None, index

    def forget_model(self) -> None:
        """Drop the model in memory: the next `current()` loads it again from disk."""
        self.state, self.model_index = None, -1

    def baseline(self, key: str, force: bool) -> None:
        if not self.recipe.evaluation.baseline:
            return
        old = self.manifest.baseline
        if not force and old is not None and old.key == key and old.status in FINISHED:
            old.status = "cached"
            self.echo("baseline: cached")
            self.save()
            return
        from compress.models.bundle import state_bytes

        self.echo("baseline: measuring the model before any stage")
        began = time.perf_counter()
        bundle = self.current().bundle
        metrics = self.family.measure(bundle, self.data, self.recipe, None, self.run_dir,
                                      reference=True)
        metrics["size_mb"] = round(state_bytes(bundle.model) / 1e6, 3)
        self.manifest.baseline = Baseline(status="done", key=key, metrics=metrics,
                                          wall_time_s=round(time.perf_counter() - began, 2))
        self.save()
        self.echo(f"baseline: {summary(metrics, self.task)}")

    def stages(self, base_key: str, first_forced: int) -> None:
        entries = self.manifest.stages
        model_sha: dict[int, str] = {}  # stage index -> sha256 of the model it made
        total = len(self.recipe.stages)
        for i, cfg in enumerate(self.recipe.stages):
            spec = spec_of(cfg.kind)
            name = cfg.name or cfg.kind
            source = input_stage_index(self.recipe, i)
            if not spec.takes_model:  # takes an earlier stage's file, needs no model
                input_sha = entries[source].outputs[0].sha256
            else:
                input_sha = base_key if source is None else model_sha[source]
                self.use_model_of(source)
            config = cfg.model_dump(mode="json")
            parts = [config, input_sha, self.manifest.recipe["data"],
                     self.manifest.recipe["evaluation"], self.recipe.seed]
            key = sha256_json(parts + self._code_of(cfg.kind, spec))
            old = entries[i] if i < len(entries) else None
            tag = f"[{i + 1}/{total}] {name}"
            if i < first_forced and self._reusable(old, key):
                old.status = "cached"
                if spec.makes_model:
                    self.pending, self.state, self.model_index = old, None, i
                self.echo(f"{tag}: cached")
            else:
                old = self._run_stage(i, cfg, name, config, key, input_sha, source)
                self.echo(f"{tag}: done in {old.wall_time_s:.1f} s: "
                          f"{summary(old.metrics, self.task)}")
            if i < len(entries):
                entries[i] = old
            else:
                entries.append(old)
            self.save()
            if spec.makes_model:
                model_sha[i] = old.outputs[0].sha256
        del entries[total:]
        self.save()

    def _code_of(self, kind: str, spec) -> list[str]:
        """Digests of the code a stage runs: its run module, the family's measurement, the
        modules it names, every project module they import, and the packages it ships in
        its output (every file of their folders)."""
        runner = (runner_of(kind, self.task) or spec.runner).split(":")[0]
        return (code_digests([runner, FAMILIES[self.task].module, *spec.code_modules])
                + shipped_digests(spec.shipped_code.get(self.task, ())))

    def _reusable(self, entry: StageRecord | None, key: str) -> bool:
        return bool(entry and entry.key == key and entry.finished_ok and entry.outputs
                    and all(artifact_intact(o, self.run_dir) for o in entry.outputs))

    def _run_stage(self, i: int, cfg, name: str, config: dict, key: str, input_sha: str,
                   source: int | None) -> StageRecord:
        from compress.stages.context import StageContext, State

        spec = spec_of(cfg.kind)
        folder = self.run_dir / f"{i:02d}-{cfg.kind}"
        folder.mkdir(exist_ok=True)
        if spec.takes_model:
            state = self.current()
        else:
            given = self.manifest.stages[source]
            state = State(None, list(given.outputs), source=given)
        inputs = list(state.artifacts) or [Artifact(sha256=input_sha, format="source")]
        entry = StageRecord(index=i, name=name, kind=cfg.kind, status="running", key=key,
                            config=config, started=now(), inputs=inputs, outputs=[],
                            metrics={}, wall_time_s=None)
        self.manifest.stages[i:i + 1] = [entry]
        self.save()
        ctx = StageContext(i, name, folder, self.run_dir, self.recipe, self.data, key,
                           stage_seed(cfg, self.recipe), log=self.echo, manifest=self.manifest,
                           input_sha=input_sha)
        parallel = spec.data_parallel and process_group.active()
        timed = spec.measured and self.recipe.evaluation.latency.enabled
        began = time.perf_counter()
        try:
            with process_group.solo():
                # the input model is timed again here so every ratio compares two models
                # timed in one process (a cached earlier stage's may come from another run)
                input_latency = (self.family.latency(state.bundle, self.data, self.recipe)
                                 if timed else {})
            if parallel:  # the other ranks load the same input model and join the training
                process_group.broadcast(("train", i, key))
            with contextlib.nullcontext() if parallel else process_group.solo():
                new_state = run_stage_function(cfg, self.task)(state, cfg, ctx)
            metrics = {}
            if spec.measured:
                with process_group.solo():
                    metrics = self.family.measure(new_state.bundle, self.data, self.recipe,
                                                  ctx.metrics, self.run_dir)
                metrics.update(self.family.compare(metrics, input_latency,
                                                   self._metrics_of(source)))
        except KeyboardInterrupt:
            with process_group.stops_deferred():
                self._fail(entry, "interrupted; re-run the same command to resume", began)
            raise
        except (StageError, UserError, CompressError) as exc:
            with process_group.stops_deferred():
                entry.metrics = dict(ctx.metrics)  # what the stage measured before failing
                cause = "; ".join(getattr(exc, "messages", None)
                                  or [getattr(exc, "cause", str(exc))])
                self._fail(entry, f"stage {name} failed: {cause}", began)
            raise StageError(name, cause) from None
        except Exception as exc:
            # a rank's death reaches rank 0 as a collective's error and then torchrun's
            # SIGTERM: the stop waits until the failure is in the manifest
            with process_group.stops_deferred():
                (folder / "error.log").write_text(traceback.format_exc())
                self._fail(entry, one_line(exc), began)
            raise StageError(name, f"{one_line(exc)} (traceback in {folder / 'error.log'})"
                             ) from None
        if ctx.outputs:
            metrics["size_mb"] = round(ctx.outputs[0].bytes / 1e6, 3)
        metrics.update(ctx.metrics)
        new_state.artifacts = list(ctx.outputs)
        entry.status, entry.outputs, entry.metrics = "done", list(ctx.outputs), metrics
        entry.finished = now()
        entry.wall_time_s = round(time.perf_counter() - began, 2)
        if spec.makes_model:
            self.state, self.pending, self.model_index = new_state, None, i
        shutil.rmtree(ctx.checkpoint_dir, ignore_errors=True)
        return entry

    def _metrics_of(self, index: int | None) -> dict[str, Any] | None:
        """Figures of the model made by stage `index` (None: the baseline), if measured."""
        entry = self.manifest.entry(index)
        return entry.metrics if entry is not None else None

    def _fail(self, entry: StageRecord, cause: str, began: float) -> None:
        entry.status, entry.error, entry.finished = "failed", cause, now()
        entry.wall_time_s = round(time.perf_counter() - began, 2)
        self.save()




def run_stage_function(cfg, task: str = "classification"):
    """The run function of a stage config's kind for a model family, imported on first use."""
    return import_function(runner_of(cfg.kind, task))


def stage_seed(cfg, recipe) -> int:
    """The seed of a stage: its own `seed` option, else the recipe's."""
    return cfg.seed if getattr(cfg, "seed", None) is not None else recipe.seed


def summary(metrics: dict[str, Any], task: str = "classification") -> str:
    """The headline figures of a stage, for its progress line."""
    from compress.recipe.family_specs import family

    parts = []
    for key in family(task).headline:
        if key in metrics:
            parts.append(f"{key} {metrics[key]}")
    return ", ".join(parts)

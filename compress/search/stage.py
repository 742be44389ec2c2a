"""Stage `search`: the fastest servable artifact within a quality budget, judged by the
family's `Quality` (quality.py: a classifier's `max_accuracy_drop` points here; an embedding
model's fidelity in `compress.families.embedding.stages.search`).

Every candidate that applies is built into `trials/<id>/` and measured the same way
(trials.py). A quantizing candidate that loses too much gets float fallback
layers, the most int8-sensitive first (sensitivity.py, `sensitivity.json`), one more per
trial, until it is within the budget or no faster than the float model. The finalists
are timed again in alternating rounds in this process (choice.py), and the winner's export
folder becomes the stage's output; `search.json`, `section.md` and `search.png` say why it
won and why every other trial lost. With `shapes`, smaller students are trained too
(shapes.py), cheapest first, and every candidate is tried on each of them as well.
"""

from __future__ import annotations

import os
import time
from typing import Any

from compress.algorithms.sensitivity import KL, Divergence, fallback_layers
from compress.errors import CompressError, UserError
from compress.recipe.kinds.search import (
    CANDIDATES,
    OBJECTIVES,
    SearchConfig,
    ShapeSpec,
)
from compress.runfolder.files import atomic_write_json, read_json, sha256_json
from compress.runfolder.records import artifact_record
from compress.search.candidates import applicable, build, candidate_stages
from compress.search.choice import decide, describe, retime_finalists
from compress.search.quality import AccuracyDrop, Quality
from compress.search.report import write_search_files
from compress.search.shapes import (
    ShapeTrainer,
    load_or_train,
    ordered_shapes,
    shape_key,
    train_shape,
)
from compress.search.trials import Measurer, cached_trial, run_trial, trial_id, trial_key
from compress.stages.context import StageContext, State
from compress.train.loop import TrainSetup


class Search:
    """The trials of one search stage, in its folder."""

    def __init__(self, state: State, cfg: SearchConfig, ctx: StageContext, quality: Quality,
                 trainer: ShapeTrainer = train_shape, divergence: Divergence = KL,
                 meta: dict[str, Any] | None = None):
        """A family's `quality`, shape `trainer`, layer-ranking `divergence` and the `meta`
        of every trial's export.json (defaults: a classifier's)."""
        self.bundle, self.cfg, self.ctx = state.bundle, cfg, ctx
        self.entering = state.bundle  # the teacher of every shape
        self.quality, self.trainer, self.divergence = quality, trainer, divergence
        self.meta = meta
        lat = ctx.recipe.evaluation.latency
        self.threads = cfg.threads or lat.threads or os.cpu_count() or 1
        self.metric = OBJECTIVES[cfg.objective]
        self.measurer = Measurer(ctx.data, ctx.recipe, self.threads, quality, self.metric)
        self.trials: list[dict[str, Any]] = []
        self.not_run: list[dict[str, Any]] = []
        self.ran = 0
        self.began = time.perf_counter()
        self.reference: dict[str, Any] = {}
        self.planned = 0  # candidates without fallback layers, for the progress lines
        self.built_s: list[float] = []  # how long each trial built here took
        self.input_sha = ctx.input_sha  # of the model the trials build from
        self.shape: dict[str, Any] | None = None  # its shape record (None: the entering model)
        self.shapes: list[dict[str, Any]] = []

    def log(self, message: str) -> None:
        self.ctx.log(f"{self.ctx.name}: {message}")

    def measure_reference(self) -> None:
        """The entering (float, eager) model measured like a trial: what the family's
        quality counts from (the accuracy and predictions of a classifier)."""
        path = self.ctx.folder / "reference.json"
        key = sha256_json(["reference", self.ctx.input_sha, self.measurer.settings()])
        cached = read_json(path)
        if cached.get("key") != key:
            self.log("measuring the entering model (PyTorch eager) as the reference")
            from compress.models.bundle import state_bytes

            cached = {"key": key, **self.measurer.measure(self.bundle, None),
                      "bytes": state_bytes(self.bundle.model)}
            atomic_write_json(path, cached)
        self.reference = cached

    def budget_spent(self) -> str | None:
        """Why no new trial may start (None: it may)."""
        if self.cfg.max_trials is not None and len(self.trials) >= self.cfg.max_trials:
            return f"max_trials {self.cfg.max_trials} reached"
        spent = time.perf_counter() - self.began
        if self.cfg.time_budget_s is not None and spent >= self.cfg.time_budget_s:
            return f"time_budget_s {self.cfg.time_budget_s:g} spent"
        return None

    def trial(self, name: str, float_layers: list[str]) -> dict[str, Any] | None:
        """The trial of `name` with `float_layers`, from the cache or built and measured
        now (None when the budget is spent)."""
        stages = candidate_stages(name, float_layers, self.cfg.calibration,
                                  self.cfg.smoothing)
        key = trial_key(name, stages, float_layers, self.input_sha, self.measurer.settings(),
                        type(self.bundle.model).__module__)
        tid = trial_id(name, float_layers, key)
        if self.shape is not None:
            tid = f"{self.shape['label']}-{tid}"
        folder = self.ctx.folder / "trials" / tid
        record = cached_trial(folder, key)
        if record is not None:
            record["cached"] = True
        else:
            if (spent := self.budget_spent()) is not None:
                self.not_run.append({"id": tid, "candidate": name, "float_layers": float_layers,
                                     "status": "not run", "lost": spent})
                self.log(f"{tid}: not run ({spent})")
                return None
            self.log(f"trial {len(self.trials) + 1} {tid}: building {CANDIDATES[name][0]}"
                     + (f", {len(float_layers)} layers in float" if float_layers else "")
                     + f" ({self._progress()})")
            record = {"id": tid, "key": key, "candidate": name, "float_layers": float_layers,
                      "stages": [s.model_dump(mode="json", exclude_unset=True) for s in stages]}
            data = self.ctx.data
            record = run_trial(folder, record, lambda out: build(
                self.bundle, stages, out, data.splits.get("calibration"), data.max_length,
                lambda m: None, self.meta), self.measurer, self.reference)
            record["cached"] = False
            self.ran += 1
            self.built_s.append(record["trial_s"])
        record["folder"] = str(folder.relative_to(self.ctx.run_dir))
        record["shape"] = None if self.shape is None else self.shape["label"]
        if record["status"] == "ok":
            self.quality.judge(record, self.reference)
        self.trials.append(record)
        self.log(describe(record, self.metric, self.quality))
        return record

    def _progress(self) -> str:
        """Elapsed time and, while candidates are left, an estimate of what they need."""
        elapsed = time.perf_counter() - self.began
        left = self.planned - len(self.trials)
        if left <= 0 or not self.built_s:
            return f"{elapsed:.0f} s into the search"
        eta = left * sum(self.built_s) / len(self.built_s)
        return f"{elapsed:.0f} s into the search, about {eta:.0f} s for the {left} candidates left"

    def float_objective(self) -> float:
        """The objective of the fastest float candidate measured (else the eager model)."""
        floats = [t[self.metric] for t in self.trials if t["status"] == "ok"
                  and not CANDIDATES[t["candidate"]][4] and self.metric in t]
        return min(floats, default=self.reference.get(self.metric, float("inf")))

    def bar(self) -> tuple[float, str]:
        """What a fallback trial must beat, and what it is: float layers only add time
        (and bytes), so a trial no better than the float model or than the best trial
        already within the tolerance cannot win."""
        within = [t[self.metric] for t in self.trials if t["status"] == "ok" and t["within"]]
        best = min(within, default=float("inf"))
        if best < self.float_objective():
            return best, "no better than the best trial within the tolerance"
        return self.float_objective(), "no better than the float model"

    def fall_back(self, name: str, ranking: list[str]) -> None:
        """Trials of `name` with the top 1, 2, ... layers of `ranking` in float, until one
        is within the tolerance, is no faster than the float model, or fails."""

        def good(layers: list[str]) -> bool | None:
            record = self.trial(name, layers)
            if record is None or record["status"] != "ok":
                return None
            bar, what = self.bar()
            if not record["within"] and record[self.metric] >= bar:
                record["stopped"] = f"{what}: fallback stopped"
                self.log(f"{record['id']}: {record['stopped']}")
                return None
            return record["within"]

        fallback_layers(ranking, good, self.cfg.max_fallback_layers)

    def sensitivity(self) -> list[str]:
        """Layer names, most int8-sensitive first (`sensitivity.json`, cached)."""
        from compress.algorithms.sensitivity import rank_layers, sensitivity_report
        from compress.data.datasets import iterate

        path = self.ctx.folder / "sensitivity.json"
        if self.shape is not None:
            path = self.ctx.folder / "shapes" / self.shape["folder"] / "sensitivity.json"
        calibration = self.ctx.data.splits["calibration"]
        count = min(self.cfg.sensitivity_samples, len(calibration))
        key = sha256_json(["sensitivity", self.input_sha, count, self.divergence.name,
                           self.cfg.calibration.batch_size, self.measurer.settings()])
        cached = read_json(path)
        if cached.get("key") != key:
            self.log(f"ranking layers by int8 sensitivity on {count} calibration examples")
            began = time.perf_counter()
            batches = [inputs for inputs, _ in iterate(
                calibration, self.cfg.calibration.batch_size, self.bundle.tokenizer,
                self.ctx.data.max_length, list(range(count)))]
            ranking = rank_layers(self.bundle.model, batches, divergence=self.divergence)
            cached = {"key": key, **sensitivity_report(ranking, count, began,
                                                       self.divergence)}
            atomic_write_json(path, cached)
        top = ", ".join(f"{r['layer']} ({r['score']:.3g})" for r in cached["ranking"][:3])
        self.log(f"most int8-sensitive layers ({self.divergence.name}): {top}")
        return [r["layer"] for r in cached["ranking"]]


    def use_shape(self, spec: ShapeSpec) -> bool:
        """Train (or load) `spec` and make it the model the next trials build from; False
        when the budget is spent before a shape that is not cached yet."""
        cfg, ctx = self.cfg, self.ctx
        key = shape_key(spec, cfg.shape_training, ctx.input_sha, ctx.seed)
        folder = ctx.folder / "shapes" / f"{spec.label}-{key[:8]}"
        if (folder / "model").is_dir() or (spent := self.budget_spent()) is None:
            began = time.perf_counter()

            def setup(checkpoints, desc: str) -> TrainSetup:
                return TrainSetup(ctx.data.splits["train"], ctx.data.max_length, ctx.seed,
                                  checkpoints, sha256_json([key, str(checkpoints.name)]), desc)

            self.bundle, record = load_or_train(
                self.entering, spec, cfg.shape_training, key, folder, setup,
                lambda m: self.log(f"shape {spec.label}: {m}"), self.trainer)
            record.update(folder=folder.name, train_s=round(time.perf_counter() - began, 1))
            self.log(f"shape {spec.label}: {'cached' if record['cached'] else 'trained'}, "
                     f"{record['layers']} layers, {record['params'] / 1e6:.1f}M parameters")
            self.input_sha, self.shape = key, record
            self.shapes.append(record)
            return True
        self.log(f"shape {spec.label}: not trained ({spent})")
        self.shapes.append({"label": spec.label, "status": "not run", "lost": spent})
        return False

    def try_candidates(self, names: list[str]) -> None:
        """Every candidate on the current model, then float fallbacks for the quantizing
        ones that lost too much."""
        for name in names:
            self.trial(name, [])
        mine = self.shape["label"] if self.shape else None
        missed = sorted((t for t in self.trials if t["status"] == "ok" and not t["within"]
                         and t.get("shape") == mine and CANDIDATES[t["candidate"]][4]),
                        key=lambda t: t[self.metric])
        ranking: list[str] | None = None
        floats = [t["within"] for t in self.trials if t["status"] == "ok"
                  and t.get("shape") == mine and not CANDIDATES[t["candidate"]][4]]
        for record in missed:
            bar, what = self.bar()
            if floats and not any(floats):
                record["stopped"] = ("the float model of this shape is outside the budget "
                                     "too: no fallback tried")
                self.log(f"{record['id']}: {record['stopped']}")
            elif record[self.metric] >= bar:
                record["stopped"] = f"{what}: no fallback tried"
                self.log(f"{record['id']}: {record['stopped']}")
            elif self.cfg.max_fallback_layers and self.budget_spent() is None:
                ranking = ranking or self.sensitivity()
                self.fall_back(record["candidate"], ranking)


def run(state: State, cfg: SearchConfig, ctx: StageContext) -> State:
    """Search a classifier (or any model whose quality is accuracy on labels)."""
    quality = AccuracyDrop(ctx.data, ctx.recipe, cfg.max_accuracy_drop)
    return run_search(Search(state, cfg, ctx, quality))


def run_search(search: Search) -> State:
    """Search, write the record and the plot, and hand on the winner's export."""
    from compress.models.folders import load_export

    cfg, ctx, entering = search.cfg, search.ctx, search.entering
    names, skipped = applicable(entering, cfg)
    for name, why in skipped.items():
        search.log(f"{name} skipped: it {why}")
    if not names:
        raise UserError(f"stages.{ctx.index}.candidates: none applies to this model on this "
                        f"machine ({'; '.join(f'{n} {w}' for n, w in skipped.items())})")
    search.measure_reference()
    shapes = ordered_shapes(cfg, entering, len(ctx.data.splits.get("train") or []))
    search.planned = len(names) * (1 + len(shapes))
    search.try_candidates(names)
    for spec in shapes:
        if search.use_shape(spec):
            search.try_candidates(names)
    retime_finalists(search.trials, cfg, search.metric, search.measurer, ctx.run_dir, search.log)
    outcome = decide(search.trials, search.metric, search.quality)
    summary = write_search_files(ctx.folder, ctx.run_dir, cfg, search, skipped, outcome)
    ctx.metrics.update(summary)
    winner = outcome["winner"]
    if winner is None:
        raise CompressError(outcome["verdict"])
    folder = ctx.run_dir / winner["folder"] / winner["export_dir"]
    ctx.add_output(artifact_record(folder / winner["file"], ctx.run_dir, winner["export_dir"],
                                   export_dir=str(folder.relative_to(ctx.run_dir)),
                                   trial=winner["id"]))
    search.log(outcome["verdict"])
    return State(load_export(folder, search.threads))

"""The run loop: validate, find sources, load data, then baseline and stages with caching.

The manifest is the truth about a run folder. It is rewritten atomically after every
change, a stage is marked done only once its outputs are on disk, and a stage whose
config and input artifact are unchanged is reported as cached instead of run again.
What a stage kind is (leaf, data-parallel, measured...) comes from its spec; this module
names no kind.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from compress.distributed import process_group
from compress.errors import CompressError, StageError, UserError, one_line
from compress.pipeline.fingerprint import data_fingerprint, model_fingerprint
from compress.recipe.chain import hardware_needed, model_stage_index
from compress.recipe.registry import HARDWARE
from compress.recipe.schema import Recipe
from compress.recipe.sources import check_recipe_sources, model_task
from compress.runfolder.files import run_lock, sha256_json
from compress.runfolder.records import read_manifest


def log(message: str) -> None:
    """Progress lines go to stderr; stdout is kept for results."""
    print(message, file=sys.stderr, flush=True)


def run_recipe(recipe: Recipe, *, force: bool = False, from_stage: str | int | None = None,
               echo: Callable[[str], None] = log) -> Path:
    """Run a validated recipe; return its run folder. Raises UserError or StageError."""
    from compress.pipeline.runner import Runner
    from compress.recipe.family_specs import functions

    check_hardware(recipe)
    model_src, data_src = check_recipe_sources(recipe)
    task = model_task(recipe.model.task, model_src)
    first_forced = _first_forced(recipe, force, from_stage)
    data = functions(task).load_data(recipe, data_src)  # torch is imported from here on
    base_key = sha256_json([model_fingerprint(recipe.model, model_src),
                            data_fingerprint(recipe, data_src),
                            recipe.evaluation.model_dump(mode="json"), recipe.seed])
    run_dir = Path(recipe.output_dir) / recipe.name
    if process_group.init() and not process_group.is_main():
        _follow(recipe, run_dir, data, model_src, task)
        process_group.shutdown()  # leave the group cleanly (no C++ abort at exit)
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    with run_lock(run_dir, "another compress run is using this folder"):
        runner = Runner(recipe, run_dir, data, model_src, echo, task)
        runner.start()
        try:
            runner.baseline(base_key, force=first_forced == 0 and force)
            runner.stages(base_key, first_forced)
        finally:
            _write_reports(run_dir, echo)
    process_group.broadcast(("end",))  # the other ranks may leave
    process_group.shutdown()
    return run_dir


def check_hardware(recipe: Recipe) -> None:
    """UserError for every stage that needs hardware this machine lacks (a CUDA GPU)."""
    problems = []
    for i, need in hardware_needed(recipe):
        what, present = HARDWARE[need]
        if not present():
            problems.append(f"stages.{i}: this stage needs {what}, and none is found on "
                            f"this machine; run the recipe where there is one")
    if problems:
        raise UserError(problems)


def _follow(recipe: Recipe, run_dir: Path, data, model_src, task: str) -> None:
    """A rank other than 0: train each data-parallel stage rank 0 announces, with the
    same input model, key and seed; write nothing (rank 0 owns the run folder)."""
    from compress.pipeline.runner import Runner, run_stage_function, stage_seed
    from compress.stages.context import StageContext

    runner = Runner(recipe, run_dir, data, model_src, echo=lambda _: None, task=task)
    while True:
        message = process_group.broadcast()
        if message[0] == "end":
            return
        _, i, key = message
        cfg = recipe.stages[i]
        runner.manifest = read_manifest(run_dir) or runner.manifest
        runner.use_model_of(model_stage_index(recipe, i))
        ctx = StageContext(i, cfg.name or cfg.kind, run_dir / f"{i:02d}-{cfg.kind}", run_dir,
                           recipe, data, key, stage_seed(cfg, recipe), log=lambda _: None)
        try:
            run_stage_function(cfg, task)(runner.current(), cfg, ctx)
        except (StageError, UserError):
            raise
        except CompressError as exc:
            raise StageError(ctx.name, f"rank {process_group.rank()}: {exc}") from None
        except Exception as exc:
            raise StageError(ctx.name, f"rank {process_group.rank()}: {one_line(exc)}") from None
        runner.forget_model()  # the next stage reloads from disk


def _write_reports(run_dir: Path, echo: Callable[[str], None]) -> None:
    """report.json, report.md and report.png after every run, finished or not; a report
    that cannot be written is a warning, never the run's error."""
    from compress.report.build import write_reports

    try:
        written = write_reports(run_dir)
    except Exception as exc:  # noqa: BLE001 - the run's own outcome must not be masked
        echo(f"warning: the report could not be written: {one_line(exc)}")
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

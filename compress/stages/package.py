"""Stage `package`: a TorchServe `.mar` of an earlier export, ready for `compress serve`."""

from __future__ import annotations

import os
import time

from compress.errors import StageError
from compress.recipe import export_stage_index
from compress.runfolder import artifact_record, read_manifest
from compress.stages.configs import PackageConfig
from compress.state import StageContext, State
from serve.package import SERVED_METRICS, build_mar, model_config, worker_threads


def run(state: State, cfg: PackageConfig, ctx: StageContext) -> State:
    """Archive the export named by `cfg.artifact` with the batching handler."""
    manifest = read_manifest(ctx.run_dir) or {}
    index = export_stage_index(ctx.recipe, ctx.index)
    export = manifest["stages"][index]
    export_dir = ctx.run_dir / export["outputs"][0]["export_dir"]
    name = cfg.model_name or ctx.recipe.name
    threads = worker_threads(cfg.threads, cfg.workers)
    if cfg.threads and cfg.threads > threads:
        ctx.log(f"package: {cfg.workers} workers x {cfg.threads} threads exceed the "
                f"{os.cpu_count()} cores; each worker gets {threads}")
    handler = {"threads": threads, "max_length": ctx.recipe.data.max_length,
               "max_text_chars": cfg.max_text_chars}
    config = model_config(cfg.batch_size, cfg.max_batch_delay_ms, cfg.workers,
                          cfg.response_timeout_s, handler)
    summary = _summary(manifest, export, name, cfg.version)
    began = time.perf_counter()
    try:
        path = build_mar(export_dir, ctx.folder, name, cfg.version, config, summary)
    except RuntimeError as exc:
        raise StageError(ctx.name, str(exc)) from None
    record = artifact_record(path, ctx.run_dir, "mar")
    record.update(model_name=name, version=cfg.version, source_stage=export["name"],
                  served_format=export["outputs"][0]["format"])
    ctx.outputs.append(record)
    ctx.metrics.update(package_s=round(time.perf_counter() - began, 3), served_model=name,
                       served_format=record["served_format"], batch_size=cfg.batch_size,
                       max_batch_delay_ms=cfg.max_batch_delay_ms, workers=cfg.workers,
                       threads_per_worker=threads)
    ctx.log(f"package: {path.relative_to(ctx.run_dir)} ({record['bytes'] / 1e6:.1f} MB); "
            f"serve it with: compress serve {ctx.run_dir}")
    return State(None, [record])


def _summary(manifest: dict, export: dict, name: str, version: str) -> dict:
    """What the run measured for the packaged artifact (`compress.json` in the archive)."""
    metrics = export.get("metrics") or {}
    baseline = (manifest.get("baseline") or {}).get("metrics") or {}
    return {"model_name": name, "version": version, "run": manifest.get("name"),
            "recipe": manifest.get("recipe"), "created": manifest.get("created"),
            "artifact": {"stage": export["name"], "format": export["outputs"][0]["format"],
                         "sha256": export["outputs"][0]["sha256"],
                         **{k: metrics[k] for k in SERVED_METRICS if k in metrics}},
            "baseline": {k: baseline[k] for k in SERVED_METRICS if k in baseline},
            "environment": manifest.get("environment")}

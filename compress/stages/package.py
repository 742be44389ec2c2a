"""Stage `package`: a TorchServe `.mar` of an earlier export, ready for `compress serve`."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from compress.errors import CompressError
from compress.recipe.kinds.package import PackageConfig
from compress.runfolder.records import Manifest, StageRecord, artifact_record
from compress.serving.archive import (
    CLASSIFIER,
    SERVED_METRICS,
    build_mar,
    code_tree,
    model_config,
)
from compress.stages.context import StageContext, State
from serve.handler_settings import UnknownSetting
from serve.worker_threads import worker_threads


def run(state: State, cfg: PackageConfig, ctx: StageContext) -> State:
    """Archive the export that enters the stage (`state.source`) with the batching handler."""
    threads = worker_threads(cfg.threads, cfg.workers)
    handler = {"threads": threads, "max_length": ctx.recipe.data.max_length,
               "max_text_chars": cfg.max_text_chars, "length_buckets": cfg.length_buckets}
    return archive(state, cfg, ctx, handler)


def archive(state: State, cfg: PackageConfig, ctx: StageContext, handler: dict[str, Any],
            handler_class: str = CLASSIFIER, served_metrics: tuple[str, ...] = SERVED_METRICS,
            settings: dict[str, Any] | None = None, code: tuple[Path, Path] | None = None,
            ) -> State:
    """Build `<model_name>.mar` of the export entering the stage with `handler_class`
    ("module:Class" in its family's package) and the code it ships (`code`: a `code_tree`
    already written, or one written here), its settings in model-config.yaml's `handler:`
    section (and `settings`, more top-level TorchServe keys)."""
    export = state.source
    export_dir = ctx.run_dir / export.outputs[0].export_dir
    name = cfg.model_name or ctx.recipe.name
    threads = handler["threads"]
    if cfg.threads and cfg.threads > threads:
        ctx.log(f"package: {cfg.workers} workers x {cfg.threads} threads exceed the "
                f"{os.cpu_count()} cores; each worker gets {threads}")
    config = model_config(cfg.batch_size, cfg.max_batch_delay_ms, cfg.workers,
                          cfg.response_timeout_s, handler, cfg.startup_timeout_s)
    config.update(settings or {})
    summary = _summary(ctx.manifest, export, name, cfg.version, served_metrics)
    began = time.perf_counter()
    try:
        path = build_mar(export_dir, ctx.folder, name, cfg.version, config, summary,
                         handler_class, code)
    except UnknownSetting as exc:  # a handler section this archive's handler cannot read
        raise CompressError(f"package: {exc}") from None
    except RuntimeError as exc:
        raise CompressError(str(exc)) from None
    served_format = export.outputs[0].format
    record = ctx.add_output(artifact_record(
        path, ctx.run_dir, "mar", model_name=name, version=cfg.version,
        source_stage=export.name, served_format=served_format))
    ctx.metrics.update(package_s=round(time.perf_counter() - began, 3), served_model=name,
                       served_format=served_format, batch_size=cfg.batch_size,
                       max_batch_delay_ms=cfg.max_batch_delay_ms, workers=cfg.workers,
                       threads_per_worker=threads)
    ctx.log(f"package: {path.relative_to(ctx.run_dir)} ({record.bytes / 1e6:.1f} MB); "
            f"serve it with: compress serve {ctx.run_dir}")
    return State(None)



def encoder_archive(state: State, cfg: PackageConfig, ctx: StageContext, task: str,
                    handler_class: str, entry: str, served_metrics: tuple[str, ...]) -> State:
    """An embedding or reranker archive: the export entering the stage with `handler_class`
    (a `serve.exported_encoder` handler), whose code tree is written here with `entry` as
    its root module, and the encoder handlers' settings."""
    handler = {"task": task, "threads": worker_threads(cfg.threads, cfg.workers),
               "max_text_chars": cfg.max_text_chars, "length_buckets": cfg.length_buckets}
    code = code_tree(ctx.folder / ".archive_code", handler_class, entry)
    try:
        return archive(state, cfg, ctx, handler, handler_class, served_metrics, code=code)
    finally:
        shutil.rmtree(code[0].parent, ignore_errors=True)


def _summary(manifest: Manifest, export: StageRecord, name: str, version: str,
             served_metrics: tuple[str, ...] = SERVED_METRICS) -> dict[str, Any]:
    """What the run measured for the packaged artifact (`compress.json` in the archive)."""
    metrics = export.metrics
    baseline = manifest.baseline.metrics if manifest.baseline else {}
    output = export.outputs[0]
    return {"model_name": name, "version": version, "run": manifest.name,
            "recipe": manifest.recipe, "created": manifest.created,
            "artifact": {"stage": export.name, "format": output.format,
                         "sha256": output.sha256,
                         **{k: metrics[k] for k in served_metrics if k in metrics}},
            "baseline": {k: baseline[k] for k in served_metrics if k in baseline},
            "environment": manifest.environment}

"""Stage `export`: write the model in a deployable format, load it back in that format's
own runtime, and prove parity on real eval batches before recording it.

The exported folder (`<stage>/<format>/`) is written under a temporary name and renamed
when complete. An export whose parity is out of bounds fails the stage with the figures;
its folder stays for inspection and is not recorded as an output. Accuracy and latency
of the stage are those of the exported file in its runtime.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compress.data.datasets import Examples, iterate
from compress.measure import parity
from compress.models.bundle import ModelBundle, count_params, sparsity
from compress.models.folders import load_export
from compress.recipe.kinds.export import ExportConfig
from compress.runfolder.records import artifact_record
from compress.stages.context import StageContext, State
from export.folder import write_export


def export(bundle: ModelBundle, cfg: ExportConfig, folder: Path,
           calibration: Examples | None = None, max_length: int = 128,
           log: Callable[[str], None] = print, meta: dict[str, Any] | None = None
           ) -> tuple[Path, dict[str, Any]]:
    """Write `bundle` in `cfg.format` into `folder` (export.folder.write_export); the
    exported file and what was done. `calibration` feeds ONNX Runtime static int8, in
    batches of `cfg.calibration`; `meta` goes into export.json."""
    batches = None
    if calibration is not None:
        order = list(range(min(cfg.calibration.samples, len(calibration))))
        batches = (inputs for inputs, _ in iterate(calibration, cfg.calibration.batch_size,
                                                    bundle.tokenizer, max_length, order))
    return write_export(bundle, cfg, folder, batches, log, meta)


def run(state: State, cfg: ExportConfig, ctx: StageContext) -> State:
    """Export the model that entered the stage (or `cfg.source`'s); check and record it."""
    bundle = state.bundle
    final = ctx.folder / cfg.format
    path, facts = export(bundle, cfg, final, ctx.data.splits.get("calibration"),
                         ctx.data.max_length, lambda m: ctx.log(f"{ctx.name}: {m}"))
    ctx.metrics.update(facts)
    threads = cfg.threads or ctx.recipe.evaluation.latency.threads or os.cpu_count() or 1
    exported = load_export(final, threads)
    evaluation = ctx.recipe.evaluation
    examples = ctx.data.splits["eval"]
    partial = bool(cfg.parity_samples and cfg.parity_samples < len(examples))
    if partial:
        examples = examples.head(cfg.parity_samples)
    figures = parity.compare(bundle.model, exported.model, examples, evaluation.batch_size,
                             bundle.tokenizer, ctx.data.max_length, ctx.data.num_labels)
    (final / "parity.json").write_text(json.dumps(figures, indent=2))
    tolerance, agreement, max_drop = bounds(cfg, bundle.kind, float_dtype(bundle))
    ctx.metrics.update(figures)
    if partial:
        for key in ("accuracy", "macro_f1"):  # not the whole split: measured again after
            ctx.metrics[f"parity_{key}"] = ctx.metrics.pop(key)
    ctx.metrics.update(parity_tolerance=tolerance, parity_min_agreement=agreement,
                       parity_max_accuracy_drop=max_drop,
                       runtime=cfg.format, runtime_threads=threads,
                       params=count_params(bundle.model), sparsity=round(sparsity(bundle.model), 6))
    parity.check(figures, tolerance, agreement, max_drop, str(final.relative_to(ctx.run_dir)))
    ctx.add_output(artifact_record(path, ctx.run_dir, cfg.format,
                                   export_dir=str(final.relative_to(ctx.run_dir))))
    return State(exported)


def reload(folder: Path, config: dict[str, Any], threads: int | None,
           override: int | None = None) -> ModelBundle:
    """The exported file in its runtime, with `override` threads, else the stage's
    `threads`, else `threads` (the latency harness's)."""
    return load_export(folder, override or config.get("threads") or threads)


def float_dtype(bundle: ModelBundle) -> str:
    """The dtype of the model's first floating parameter ("float32" when it has none)."""
    import torch

    floats = (p.dtype for p in bundle.model.parameters() if p.is_floating_point())
    return str(next(floats, torch.float32)).removeprefix("torch.")


def bounds(cfg: ExportConfig, source_kind: str, dtype: str = "float32"
           ) -> tuple[float | None, float, float | None]:
    """(max-abs logit tolerance, minimum argmax agreement, largest accuracy drop in points)
    for this export; None means unchecked.

    Exports that change precision (ONNX Runtime int8, TensorRT fp16) and exports of an int8
    model or a bf16 one (whose in-process kernels round differently) are held to agreement
    only."""
    lossy = cfg.quantizes or source_kind == "pt2e" or dtype != "float32"
    tolerance = cfg.tolerance
    if tolerance is None and not lossy:
        tolerance = parity.LOSSLESS_TOLERANCE[cfg.format]
    agreement = cfg.min_agreement or (
        parity.QUANTIZING_AGREEMENT if cfg.quantizes else parity.LOSSLESS_AGREEMENT)
    max_drop = cfg.max_accuracy_drop
    if max_drop is None and cfg.quantizes:
        max_drop = parity.QUANTIZING_MAX_DROP
    return tolerance, agreement, max_drop


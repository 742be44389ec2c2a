"""Stage `export` on a reranker: the shared formats (ONNX, ONNX Runtime int8, AOTInductor,
TorchScript), with `export.json`'s `reranker` block saying what a server of the file must
know (its activation, already in the graph, and its longest pair), held to parity with the
model that entered the stage on the eval pairs: a lossless file by the largest absolute
score difference (`tolerance`), an int8 or bf16 one (or a file of an int8 model) by
Kendall's tau per query against the source's scores, averaged over the queries
(`min_kendall_tau`, default 0.9; near-ties within `measures.TIE_MARGIN` not counted)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from compress.errors import ParityError
from compress.families.reranker.family import score
from compress.families.reranker.measures import TIE_MARGIN, agreement
from compress.families.reranker.pairs import groups_of
from compress.models.folders import load_export
from compress.recipe.kinds.export import ExportConfig
from compress.runfolder.records import artifact_record
from compress.stages.context import StageContext, State
from compress.stages.export import bounds, export, float_dtype

ROUNDED_KENDALL_TAU = 0.9  # int8 weights or activations, or bf16


def run(state: State, cfg: ExportConfig, ctx: StageContext) -> State:
    """Export the reranker that entered the stage; check its parity and record it."""
    bundle = state.bundle
    final = ctx.folder / cfg.format
    facts = {"outputs": ["score"], "reranker": served_facts(ctx)}  # a PT2E program has
    # lost the scorer's output_name: the file's one output is still the score
    path, made = export(bundle, cfg, final, ctx.data.splits.get("calibration"),
                        ctx.data.max_length, lambda m: ctx.log(f"{ctx.name}: {m}"), meta=facts)
    ctx.metrics.update(made)
    threads = cfg.threads or ctx.recipe.evaluation.latency.threads or os.cpu_count() or 1
    exported = load_export(final, threads)
    examples = ctx.data.splits["eval"]
    if cfg.parity_samples:
        examples = examples.head(cfg.parity_samples)
    batch, length = ctx.recipe.evaluation.batch_size, ctx.data.max_length
    want = score(bundle.model, examples, batch, bundle.tokenizer, length)
    got = score(exported.model, examples, batch, bundle.tokenizer, length)
    figures = parity(want, got, groups_of(examples))
    (final / "parity.json").write_text(json.dumps(figures, indent=2))
    tolerance, _, _ = bounds(cfg, bundle.kind, float_dtype(bundle))
    least = cfg.min_kendall_tau
    if least is None and tolerance is None:
        least = ROUNDED_KENDALL_TAU
    ctx.metrics.update(figures, parity_tolerance=tolerance, parity_min_kendall_tau=least,
                       runtime=cfg.format, runtime_threads=threads)
    problems = []
    if tolerance is not None and figures["parity_max_abs_diff"] > tolerance:
        problems.append(f"max |score difference| {figures['parity_max_abs_diff']:.3g} > "
                        f"tolerance {tolerance:g}")
    tau = figures.get("parity_kendall_tau")
    if least is not None and tau is not None and tau < least:
        problems.append(f"Kendall's tau {tau:.4f} < min_kendall_tau {least:g}")
    if problems:
        raise ParityError(f"parity check failed on {len(examples)} eval pairs: "
                          f"{'; '.join(problems)} (file kept in "
                          f"{final.relative_to(ctx.run_dir)}; raise min_kendall_tau or "
                          "tolerance to accept it)")
    ctx.add_output(artifact_record(path, ctx.run_dir, cfg.format,
                                   export_dir=str(final.relative_to(ctx.run_dir))))
    return State(exported)


def parity(want: torch.Tensor, got: torch.Tensor, groups: list[int]) -> dict[str, Any]:
    """How far the file's scores are from the source's: the largest difference, and
    Kendall's tau per query averaged (None where every pair is a near-tie)."""
    figures = agreement(got, want, groups)
    return {"parity_samples": len(want),
            "parity_max_abs_diff": figures["score_max_abs_diff"],
            "parity_kendall_tau": figures.get("kendall_tau"),
            "parity_tie_margin": TIE_MARGIN}


def served_facts(ctx: StageContext) -> dict[str, Any]:
    """What the server of the file must know of the model (from the run's manifest: the
    recipe's model as loaded): its activation and longest pair."""
    model = (ctx.manifest.model if ctx.manifest else None) or {}
    return {key: model.get(key) for key in ("activation", "max_seq_length")}

"""Stage `export` on an embedding model: the shared formats (ONNX, ONNX Runtime int8, AOTI,
TorchScript), with `export.json` saying what a server of the file must know (pooling,
normalization, width, longest input, and prompts and truncate_dim where the model has
them), held to fidelity: the mean cosine between the file's
embeddings and its source model's on the eval texts, with the model's default prompt as
encode and the server put it (`min_fidelity`), and for a lossless
export the largest absolute difference too (`tolerance`)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from compress.data.datasets import Examples
from compress.errors import ParityError
from compress.families.embedding.family import RECALL_K, embed, model_facts, quality
from compress.models.folders import load_export
from compress.recipe.kinds.export import ExportConfig
from compress.runfolder.records import artifact_record
from compress.stages.context import StageContext, State
from compress.stages.export import bounds, export, float_dtype

LOSSLESS_FIDELITY = 0.99999
ROUNDED_FIDELITY = 0.99  # int8 weights or activations, or bf16
# what the server reads where the model's folder had it (serve/embedding/requests.py)
SERVED_IF_SET = ("prompts", "default_prompt_name", "truncate_dim")


def run(state: State, cfg: ExportConfig, ctx: StageContext) -> State:
    """Export the encoder that entered the stage; check its fidelity and record it."""
    bundle = state.bundle
    final = ctx.folder / cfg.format
    facts = {"outputs": ["embedding"], "embedding": served_facts(ctx)}  # a PT2E program
    # has lost the encoder's output_name: the file's one output is still the embedding
    path, made = export(bundle, cfg, final, ctx.data.splits.get("calibration"),
                        ctx.data.max_length, lambda m: ctx.log(f"{ctx.name}: {m}"), meta=facts)
    ctx.metrics.update(made)
    threads = cfg.threads or ctx.recipe.evaluation.latency.threads or os.cpu_count() or 1
    exported = load_export(final, threads)
    examples = prompted(ctx.data.splits["eval"], bundle.model)
    if cfg.parity_samples:
        examples = examples.head(cfg.parity_samples)
    batch, length = ctx.recipe.evaluation.batch_size, ctx.data.max_length
    want = embed(bundle.model, examples, batch, bundle.tokenizer, length)
    got = embed(exported.model, examples, batch, bundle.tokenizer, length)
    figures = parity(want, got)
    (final / "parity.json").write_text(json.dumps(figures, indent=2))
    tolerance, _, _ = bounds(cfg, bundle.kind, float_dtype(bundle))
    lossy = tolerance is None
    least = cfg.min_fidelity or (ROUNDED_FIDELITY if lossy else LOSSLESS_FIDELITY)
    ctx.metrics.update(figures, parity_tolerance=tolerance, parity_min_fidelity=least,
                       runtime=cfg.format, runtime_threads=threads)
    problems = []
    if tolerance is not None and figures["parity_max_abs_diff"] > tolerance:
        problems.append(f"max |difference| {figures['parity_max_abs_diff']:.3g} > "
                        f"tolerance {tolerance:g}")
    if figures["parity_fidelity"] < least:
        problems.append(f"mean cosine {figures['parity_fidelity']:.6f} < min_fidelity "
                        f"{least:g}")
    if problems:
        raise ParityError(f"parity check failed on {len(examples)} eval texts: "
                         f"{'; '.join(problems)} (file kept in "
                         f"{final.relative_to(ctx.run_dir)}; raise min_fidelity or "
                         "tolerance to accept it)")
    ctx.add_output(artifact_record(path, ctx.run_dir, cfg.format,
                                   export_dir=str(final.relative_to(ctx.run_dir))))
    return State(exported)


def prompted(examples: Examples, model: torch.nn.Module) -> Examples:
    """The texts as the model embeds them by default: with its default prompt (e5's
    `query: `), as sentence-transformers' encode and the served archive put it."""
    facts = model_facts(model)
    prompt = (facts["prompts"] or {}).get(facts["default_prompt_name"] or "", "")
    if not prompt or examples.texts is None:
        return examples
    return Examples(labels=examples.labels, texts=[prompt + t for t in examples.texts])


def parity(want: torch.Tensor, got: torch.Tensor) -> dict[str, Any]:
    """How far the file's embeddings are from the source's: differences, mean and 1st
    percentile cosine, and recall@10 of each text's neighbours."""
    figures = quality(got, want, [])
    return {"parity_samples": len(want),
            "parity_max_abs_diff": float((want - got).abs().max()),
            "parity_fidelity": figures["fidelity"],
            "parity_fidelity_p1": figures["fidelity_p1"],
            f"parity_recall_at_{RECALL_K}": figures[f"recall_at_{RECALL_K}"]}


def served_facts(ctx: StageContext) -> dict[str, Any]:
    """What the server of the file must know of the model (from the run's manifest: the
    recipe's model as loaded)."""
    model = (ctx.manifest.model if ctx.manifest else None) or {}
    facts = {key: model.get(key) for key in ("pooling", "normalize", "dimensions",
                                             "max_seq_length", "matryoshka")}
    return {**facts, **{key: model[key] for key in SERVED_IF_SET if model.get(key)}}


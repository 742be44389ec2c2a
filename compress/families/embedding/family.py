"""The embedding family's functions (see `compress.recipe.family_specs`): sentence-transformers
models scored by how close their embeddings stay to the float model's.

The model measured first in a run (the baseline) is the reference: its embeddings of the
eval texts go to `<run>/embedding_reference.safetensors`, and every later model is compared
with them (fidelity, recall@10). A model with prompts is measured as encode uses it: each
text with the default prompt (none where it has no default) for the headline figures, and
with each other prompt for `fidelity_<name>` / `recall_at_10_<name>`; the reference file
keeps the prompts it was made with (its metadata), so every later model reads the same
texts. A Matryoshka model adds `fidelity_d<N>` / `recall_at_10_d<N>` at each declared width
(`measures.widths_to_measure`). Labels, where the data has them, give k-NN accuracy.
Speed is the recipe's latency sweep plus the eval texts at their real lengths
(`real_items_per_s_bN`: sentences per second at batch N). A recipe's `evaluation.mteb`
adds each task's MTEB main score (`mteb_<task>_<metric>`, `evaluation_harness`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from compress.data.datasets import DataBundle, Examples, iterate
from compress.families.embedding.folder import load_recipe_encoder, provenance  # noqa: F401
from compress.families.embedding.measures import (
    fidelity,
    knn_accuracy,
    quality_at_widths,
    recall_at_k,
    widths_to_measure,
)
from compress.measure.evaluate import logits_of
from compress.measure.figures import compare_to_input, latency_of, speed_and_size
from compress.models.bundle import ModelBundle
from compress.report.render import MTEB

REFERENCE = "embedding_reference.safetensors"
RECALL_K = 10


def load_data(recipe, source) -> DataBundle:
    """Every split the recipe uses: texts, and labels where the data has them (k-NN)."""
    from compress.data.datasets import load_data as load_tables

    return load_tables(recipe, source, labels_required=False)


def load_model(recipe, source, data: DataBundle) -> ModelBundle:
    """The recipe's sentence-transformers model in float32."""
    return load_recipe_encoder(source.location, recipe.model.checkpoint)


@torch.inference_mode()
def embed(model: torch.nn.Module, examples: Examples, batch_size: int, tokenizer,
          max_length: int) -> torch.Tensor:
    """The embeddings of every example, in order (float32, texts x width)."""
    model.eval()
    rows = [logits_of(model, inputs).float()
            for inputs, _ in iterate(examples, batch_size, tokenizer, max_length,
                                     list(range(len(examples))))]
    return torch.cat(rows)


def quality(embeddings: torch.Tensor, reference: torch.Tensor | None,
            labels: list[int]) -> dict[str, Any]:
    """Fidelity and recall@10 against `reference` (when given), k-NN accuracy (when labelled)."""
    out: dict[str, Any] = {}
    if reference is not None:
        out.update(fidelity(embeddings, reference))
        out[f"recall_at_{RECALL_K}"] = recall_at_k(embeddings, reference, RECALL_K)
    if labels:
        out["knn_accuracy"] = knn_accuracy(embeddings, torch.tensor(labels))
    return out


def measure(bundle: ModelBundle, data: DataBundle, recipe, known: dict[str, Any] | None,
            run_dir: Path, reference: bool = False) -> dict[str, Any]:
    """Fidelity, recall@10 and k-NN accuracy on the eval split, latency (swept and at real
    lengths, with sentences/s), params and sparsity. The reference writes its embeddings."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    cfg = recipe.evaluation
    examples = data.splits["eval"]
    ref_file = run_dir / REFERENCE
    facts = model_facts(bundle.model) if reference else (
        reference_facts(ref_file, safe_open) if ref_file.is_file() else {})
    prompts = facts.get("prompts") or {}
    default = prompts.get(facts.get("default_prompt_name") or "", "")

    def embed_with(prompt: str) -> torch.Tensor:
        texts = Examples(labels=examples.labels, texts=[prompt + t for t in examples.texts])
        return embed(bundle.model, texts, cfg.batch_size, bundle.tokenizer, data.max_length)

    embeddings = embed_with(default)
    others = {name: embed_with(text) for name, text in prompts.items()
              if name != facts.get("default_prompt_name")}
    if reference:
        tmp = ref_file.with_name(f".{ref_file.name}.tmp")
        tensors = {"embeddings": embeddings, **{f"prompt.{n}": e for n, e in others.items()}}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={"facts": json.dumps(facts)})
        tmp.replace(ref_file)
        refs = tensors
    else:
        refs = load_file(str(ref_file)) if ref_file.is_file() else {}
    ref = refs.get("embeddings")
    metrics: dict[str, Any] = {**(known or {}),
                               **quality(embeddings, ref, examples.labels),
                               "dimensions": int(embeddings.shape[1])}
    for name, other in others.items():
        if f"prompt.{name}" in refs:
            figures = quality(other, refs[f"prompt.{name}"], [])
            metrics.update({f"{key}_{name}": value for key, value in figures.items()
                            if not key.endswith("_p1")})
    widths = widths_to_measure(int(embeddings.shape[1]), facts.get("matryoshka_dims") or [],
                               bool(facts.get("matryoshka")))
    if ref is not None and widths:
        metrics.update(quality_at_widths(embeddings, ref, widths, RECALL_K))
    if cfg.mteb is not None and not any(key.startswith(MTEB) for key in metrics):
        metrics.update(mteb_scores(bundle, cfg.mteb, facts, data.max_length))
    return {**metrics, **speed_and_size(bundle, examples, recipe, data.max_length)}


def mteb_scores(bundle: ModelBundle, config, facts: dict[str, Any], max_length: int
                ) -> dict[str, float]:
    """The recipe's MTEB tasks scored for the bundle's model (`evaluation.mteb`), its texts
    read as its server would read them (`facts`: the reference's prompts and widths), cut at
    the recipe's `data.max_length` tokens."""
    from compress.errors import UserError

    try:
        from compress.families.embedding import evaluation_harness as harness
    except ImportError as exc:
        raise UserError(f"evaluation.mteb needs MTEB ({exc}): pip install "
                        "'compress-pipeline[eval]'") from None
    embedder = harness.ModuleEmbedder(bundle, facts, max_length)
    try:
        return harness.task_scores(embedder, config.tasks, config.limit)
    except ValueError as exc:
        raise UserError(f"evaluation.mteb: {exc}") from None


def model_facts(model: torch.nn.Module) -> dict[str, Any]:
    """What the reference keeps of its model for every later measure: prompts, default
    prompt, Matryoshka training and widths, the width an embedding is cut at and whether it
    is normalized (a model that is no SentenceEncoder: none)."""
    return {"prompts": dict(getattr(model, "prompts", {}) or {}),
            "default_prompt_name": getattr(model, "default_prompt_name", None),
            "truncate_dim": getattr(model, "truncate_dim", None),
            "normalize": bool(getattr(model, "normalize", False)),
            "matryoshka": bool(getattr(model, "matryoshka", False)),
            "matryoshka_dims": list(getattr(model, "matryoshka_dims", ()) or ())}


def reference_facts(ref_file: Path, safe_open: Any) -> dict[str, Any]:
    """The facts the reference file was made with (its metadata; {} for an older file)."""
    with safe_open(str(ref_file), framework="pt") as handle:
        metadata = handle.metadata() or {}
    return json.loads(metadata.get("facts", "{}"))


def latency(bundle: ModelBundle, data: DataBundle, recipe) -> dict[str, Any]:
    """The recipe's latency sweep."""
    return latency_of(bundle, recipe)


def compare(metrics: dict[str, Any], input_latency: dict[str, Any],
            input_metrics: dict[str, Any] | None) -> dict[str, Any]:
    """Latency ratios and the fidelity change against the stage's input."""
    out = compare_to_input(metrics, input_latency, None)
    before = (input_metrics or {}).get("fidelity")
    if before is not None and "fidelity" in metrics:
        out["fidelity_delta_vs_input"] = round(metrics["fidelity"] - before, 6)
    return out

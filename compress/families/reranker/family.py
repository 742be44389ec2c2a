"""The reranking family's functions (see `compress.recipe.family_specs`): cross-encoders
(sentence-transformers `CrossEncoder` folders) scored on query-document pairs.

The data is a pair set grouped by query (`pairs.py`). Against the relevance labels a model
gets nDCG@10 and MRR@10; against the model measured first in a run (the baseline, the
reference: its scores of the eval pairs go to `<run>/reranker_reference.safetensors`) it
gets Kendall's tau per query, averaged over the queries (documents whose reference scores
are within `measures.TIE_MARGIN` of each other are a near-tie, not counted), and the
largest absolute score difference. Speed is the recipe's latency sweep plus the eval pairs
at their real lengths (`real_items_per_s_bN`: pairs per second at batch N).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from compress.data.datasets import DataBundle, Examples, iterate
from compress.families.reranker.folder import load_cross_encoder, provenance  # noqa: F401
from compress.families.reranker.measures import TIE_MARGIN, agreement, ranking_quality
from compress.families.reranker.pairs import groups_of, load_pairs
from compress.measure.evaluate import logits_of
from compress.measure.figures import compare_to_input, latency_of, speed_and_size
from compress.models.bundle import ModelBundle

REFERENCE = "reranker_reference.safetensors"
RANK_K = 10


def load_data(recipe, source) -> DataBundle:
    """Every split the recipe uses, as (query, document, relevance) pairs."""
    return load_pairs(recipe, source)


def load_model(recipe, source, data: DataBundle) -> ModelBundle:
    """The recipe's cross-encoder in float32 (a bare encoder's new head seeded)."""
    torch.manual_seed(recipe.seed)
    return load_cross_encoder(source.location, recipe.model.checkpoint)


@torch.inference_mode()
def score(model: torch.nn.Module, examples: Examples, batch_size: int, tokenizer,
          max_length: int) -> torch.Tensor:
    """Each pair's score, in order (float32, one value a pair)."""
    model.eval()
    rows = [logits_of(model, inputs).float().reshape(-1)
            for inputs, _ in iterate(examples, batch_size, tokenizer, max_length)]
    return torch.cat(rows)


def quality(scores: torch.Tensor, reference: torch.Tensor | None,
            examples: Examples) -> dict[str, Any]:
    """nDCG@10 and MRR@10 against the labels; Kendall's tau and the largest difference
    against `reference` (when given)."""
    groups = groups_of(examples)
    out: dict[str, Any] = dict(ranking_quality(scores, examples.labels, groups, RANK_K))
    if reference is not None:
        out.update(agreement(scores, reference, groups))
    return out


def measure(bundle: ModelBundle, data: DataBundle, recipe, known: dict[str, Any] | None,
            run_dir: Path, reference: bool = False) -> dict[str, Any]:
    """The ranking figures on the eval pairs, latency (swept and at real lengths, with
    pairs/s), params and sparsity. The reference writes its scores."""
    from safetensors.torch import save_file

    cfg = recipe.evaluation
    examples = data.splits["eval"]
    ref_file = run_dir / REFERENCE
    scores = score(bundle.model, examples, cfg.batch_size, bundle.tokenizer, data.max_length)
    if reference:
        tmp = ref_file.with_name(f".{ref_file.name}.tmp")
        save_file({"scores": scores.contiguous()}, str(tmp))
        tmp.replace(ref_file)
    ref = reference_scores(run_dir)
    metrics: dict[str, Any] = {**(known or {}), **quality(scores, ref, examples),
                               "pairs": len(examples), "queries": len(set(examples.texts)),
                               "kendall_tie_margin": TIE_MARGIN}
    return {**metrics, **speed_and_size(bundle, examples, recipe, data.max_length)}


def reference_scores(run_dir: Path) -> torch.Tensor | None:
    """The baseline's scores of the eval pairs (`REFERENCE`), None before it is measured."""
    from safetensors.torch import load_file

    path = run_dir / REFERENCE
    return load_file(str(path))["scores"] if path.is_file() else None


def latency(bundle: ModelBundle, data: DataBundle, recipe) -> dict[str, Any]:
    """The recipe's latency sweep."""
    return latency_of(bundle, recipe)


def compare(metrics: dict[str, Any], input_latency: dict[str, Any],
            input_metrics: dict[str, Any] | None) -> dict[str, Any]:
    """Latency ratios and the nDCG@10 change against the stage's input."""
    out = compare_to_input(metrics, input_latency, None)
    before = (input_metrics or {}).get(f"ndcg_at_{RANK_K}")
    if before is not None and f"ndcg_at_{RANK_K}" in metrics:
        out[f"ndcg_at_{RANK_K}_delta_vs_input"] = round(metrics[f"ndcg_at_{RANK_K}"] - before, 6)
    return out

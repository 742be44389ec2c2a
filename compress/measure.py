"""Every figure the manifest keeps for a model: accuracy, macro-F1, latency, params, sparsity."""

from __future__ import annotations

from typing import Any

from compress.bench import example_inputs, measure_latency
from compress.data import DataBundle
from compress.evaluate import evaluate, logits_of
from compress.models import ModelBundle, count_params, sparsity


def measure(bundle: ModelBundle, data: DataBundle, recipe) -> dict[str, Any]:
    """Accuracy and macro-F1 on the eval split, latency per batch size, params and sparsity."""
    cfg = recipe.evaluation
    metrics: dict[str, Any] = evaluate(
        bundle.model, data.splits["eval"], cfg.batch_size, bundle.tokenizer, data.max_length,
        data.num_labels)
    if cfg.latency.enabled:
        lat = cfg.latency
        model = bundle.model.eval()
        metrics.update(measure_latency(
            lambda inputs: logits_of(model, inputs),
            lambda batch: example_inputs(bundle.tokenizer, bundle.input_shape, batch, lat.seq_len),
            lat.batch_sizes, lat.warmup, lat.iters, lat.threads))
        if bundle.is_text:
            metrics["latency_seq_len"] = lat.seq_len
    metrics["params"] = count_params(bundle.model)
    metrics["sparsity"] = round(sparsity(bundle.model), 6)
    return metrics

"""Every figure the manifest keeps for a model: accuracy, macro-F1, latency, params, sparsity."""

from __future__ import annotations

from typing import Any

from compress.data import DataBundle
from compress.evaluate import evaluate, logits_of
from compress.harness import example_inputs, measure_latency
from compress.models import ModelBundle, count_params, sparsity


def measure(bundle: ModelBundle, data: DataBundle, recipe,
            known: dict[str, Any] | None = None) -> dict[str, Any]:
    """Accuracy and macro-F1 on the eval split (unless `known` has them, from a stage that
    already evaluated the whole split), latency per batch size, params and sparsity."""
    cfg = recipe.evaluation
    known = known or {}
    if "accuracy" in known and "macro_f1" in known:
        metrics: dict[str, Any] = {k: known[k] for k in ("accuracy", "macro_f1")}
    else:
        metrics = evaluate(bundle.model, data.splits["eval"], cfg.batch_size, bundle.tokenizer,
                           data.max_length, data.num_labels)
    if cfg.latency.enabled:
        metrics.update(latency_of(bundle, recipe))
    metrics["params"] = count_params(bundle.model)
    metrics["sparsity"] = round(sparsity(bundle.model), 6)
    return metrics


def latency_of(bundle: ModelBundle, recipe) -> dict[str, Any]:
    """The recipe's latency sweep on one model (median and p90 per batch size)."""
    return latency_sweep(bundle, recipe.evaluation.latency)


def latency_sweep(bundle: ModelBundle, lat) -> dict[str, Any]:
    """The sweep of one `LatencyConfig` on one model: median and p90 per batch size at
    `seq_len`, and for text models per (batch size, length) of `seq_lens` as
    `latency_ms_b{N}_s{L}` (with `latency_noisy_pairs` [[N, L], ...] when any is noisy)."""
    model = bundle.model.eval()

    def run(inputs: Any) -> Any:
        return logits_of(model, inputs)

    def inputs_of(length: int):
        return lambda batch: example_inputs(bundle.tokenizer, bundle.input_shape, batch, length)

    metrics = measure_latency(run, inputs_of(lat.seq_len), lat.batch_sizes, lat.warmup,
                              lat.iters, lat.threads)
    if not bundle.is_text:
        return metrics
    metrics["latency_seq_len"] = lat.seq_len
    noisy_pairs = []
    for length in dict.fromkeys(lat.seq_lens or []):
        extra = measure_latency(run, inputs_of(length), lat.batch_sizes, lat.warmup,
                                lat.iters, lat.threads, suffix=f"_s{length}")
        noisy_pairs += [[batch, length] for batch in extra.pop("latency_noisy_batches", [])]
        extra.pop("latency_threads", None)
        metrics.update(extra)
    if noisy_pairs:
        metrics["latency_noisy_pairs"] = noisy_pairs
    return metrics


def compare_to_input(metrics: dict[str, Any], input_latency: dict[str, Any],
                     input_accuracy: float | None) -> dict[str, Any]:
    """Ratios against the model that entered the stage, timed in the same process.

    `latency_ratio_bN` = this model's median / the input model's median at batch N (below 1
    is faster); `accuracy_delta_vs_input` is in points.
    """
    out: dict[str, Any] = {}
    for key, value in input_latency.items():
        if key.startswith("latency_ms_b") and not key.endswith("_p90"):
            out[f"input_{key}"] = value
            if key in metrics and value:
                out[f"latency_ratio_{key.removeprefix('latency_ms_')}"] = round(
                    metrics[key] / value, 4)
    if input_accuracy is not None and "accuracy" in metrics:
        out["accuracy_delta_vs_input"] = round(100 * (metrics["accuracy"] - input_accuracy), 3)
    return out

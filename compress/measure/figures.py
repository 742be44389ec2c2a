"""Every figure the manifest keeps for a model: accuracy, macro-F1, latency, params, sparsity."""

from __future__ import annotations

import time
from typing import Any

import torch

from compress.data.datasets import DataBundle, Examples, iterate
from compress.measure.evaluate import evaluate, logits_of
from compress.measure.latency import fixed_threads, measure_latency, summarize
from compress.models.bundle import ModelBundle, count_params, sparsity
from export.graphs import example_inputs


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
    return {**metrics, **speed_and_size(bundle, data.splits["eval"], recipe, data.max_length)}


def speed_and_size(bundle: ModelBundle, examples: Examples, recipe,
                   max_length: int) -> dict[str, Any]:
    """What every family measures beside its quality: the recipe's latency sweep and, for
    text, `examples` at their real lengths (where the recipe asks for them); params and
    sparsity."""
    latency = recipe.evaluation.latency
    out: dict[str, Any] = {}
    if latency.enabled:
        out.update(latency_of(bundle, recipe))
        if bundle.is_text and latency.real_lengths:
            out.update(real_latency(bundle, examples, latency.batch_sizes, max_length,
                                    latency.threads, limit=latency.real_limit,
                                    warmup=latency.warmup))
    out["params"] = count_params(bundle.model)
    out["sparsity"] = round(sparsity(bundle.model), 6)
    return out


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


def real_latency(bundle: ModelBundle, examples: Examples, batch_sizes: list[int],
                 max_length: int, threads: int | None = None, limit: int | None = None,
                 warmup: int = 3) -> dict[str, Any]:
    """Latency at real lengths: the split's own sentences (the first `limit`) in batches of
    N, in order, each padded to its longest (what a served model sees). Per batch size:
    `latency_ms_b{N}_real` (median ms per batch), `..._real_p90`, `real_tokens_b{N}` (mean
    padded length) and `real_items_per_s_b{N}` (sentences / total time). Text models only;
    tokenizing is done before timing, the first `warmup` batches are run untimed."""
    if examples.texts is None or bundle.tokenizer is None or not len(examples):
        return {}
    model = bundle.model.eval()
    count = len(examples) if limit is None else min(limit, len(examples))
    metrics: dict[str, Any] = {}
    with fixed_threads(threads), torch.inference_mode():
        for batch in batch_sizes:
            batches = [inputs for inputs, _ in iterate(examples, batch, bundle.tokenizer,
                                                       max_length, list(range(count)))]
            for inputs in batches[:warmup]:
                logits_of(model, inputs)
            samples = []
            for inputs in batches:
                start = time.perf_counter()
                logits_of(model, inputs)
                samples.append((time.perf_counter() - start) * 1000)
            stats = summarize(samples)
            metrics[f"latency_ms_b{batch}_real"] = round(stats["p50"], 3)
            metrics[f"latency_ms_b{batch}_real_p90"] = round(stats["p90"], 3)
            metrics[f"real_tokens_b{batch}"] = round(
                sum(b["input_ids"].shape[1] for b in batches) / len(batches), 1)
            metrics[f"real_items_per_s_b{batch}"] = round(1000 * count / sum(samples), 1)
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

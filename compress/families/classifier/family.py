"""The classifier family's functions (see `compress.recipe.family_specs`): sequence classifiers and
`module:factory` models scored by accuracy and timed per batch size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compress.data.datasets import DataBundle
from compress.measure.figures import compare_to_input, latency_of
from compress.measure.figures import measure as measure_classifier
from compress.models.bundle import ModelBundle


def load_data(recipe, source) -> DataBundle:
    """Every split the recipe uses, with labels."""
    from compress.data.datasets import load_data as load_tables

    return load_tables(recipe, source)


def load_model(recipe, source, data: DataBundle) -> ModelBundle:
    """The recipe's model with a head for the data's labels (seeded, so new heads and
    factory models initialize alike)."""
    import torch

    from compress.models.loading import load_model as build

    torch.manual_seed(recipe.seed)
    cfg = recipe.model
    return build(source, data.label_names, data.input_shape, cfg.checkpoint, cfg.kwargs,
                 cfg.num_labels)


def measure(bundle: ModelBundle, data: DataBundle, recipe, known: dict[str, Any] | None,
            run_dir: Path, reference: bool = False) -> dict[str, Any]:
    """Accuracy, macro-F1, latency per batch size, params and sparsity."""
    return measure_classifier(bundle, data, recipe, known=known)


def latency(bundle: ModelBundle, data: DataBundle, recipe) -> dict[str, Any]:
    """The recipe's latency sweep."""
    return latency_of(bundle, recipe)


def compare(metrics: dict[str, Any], input_latency: dict[str, Any],
            input_metrics: dict[str, Any] | None) -> dict[str, Any]:
    """Latency ratios and the accuracy delta against the stage's input."""
    return compare_to_input(metrics, input_latency, (input_metrics or {}).get("accuracy"))


def provenance(bundle: ModelBundle) -> dict[str, Any]:
    """Where the weights came from (nothing beyond the recipe for classifiers)."""
    return {}

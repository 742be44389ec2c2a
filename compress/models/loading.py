"""Loading a recipe's classifier: a Hugging Face sequence classifier or a `module:factory`
nn.Module, with weights read without pickle (safetensors, or
`torch.load(weights_only=True)`). A stage's saved folder is read by `compress.models.folders`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.errors import UserError
from compress.models.bundle import ModelBundle
from compress.recipe.sources import ModelSource


def load_model(source: ModelSource, label_names: list[str], input_shape: list[int],
               checkpoint: str | None = None, kwargs: dict[str, Any] | None = None,
               num_labels: int | None = None) -> ModelBundle:
    """Build the model a recipe names, with `num_labels` outputs for the data's labels."""
    num_labels = num_labels or len(label_names)
    if num_labels != len(label_names):
        raise UserError(
            f"model.num_labels: {num_labels}, but the data has {len(label_names)} labels"
        )
    if source.kind == "factory":
        model = build_factory(source.location, kwargs or {})
        bundle = ModelBundle(model, "factory", label_names, factory=source.location,
                             kwargs=dict(kwargs or {}), input_shape=list(input_shape))
    else:
        bundle = load_hf_classifier(source.location, label_names)
    if checkpoint:
        load_weights(bundle.model, checkpoint)
    return bundle


def load_hf_classifier(location: str, label_names: list[str], weights: bool = True) -> ModelBundle:
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the new classifier head's "newly initialized" notice
    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
        if not weights:  # the architecture only; the caller loads weights
            config = AutoConfig.from_pretrained(location)
            model = AutoModelForSequenceClassification.from_config(config).eval()
            return ModelBundle(model, "hf", label_names, tokenizer=tokenizer)
        model = AutoModelForSequenceClassification.from_pretrained(
            location,
            num_labels=len(label_names),
            id2label=dict(enumerate(label_names)),
            label2id={name: i for i, name in enumerate(label_names)},
            ignore_mismatched_sizes=True,
        )
    except OSError as exc:
        raise UserError(
            f"model.source: cannot load '{location}': {str(exc).splitlines()[0]}") from None
    model.eval()
    return ModelBundle(model, "hf", label_names, tokenizer=tokenizer)


def build_factory(path: str, kwargs: dict[str, Any]) -> nn.Module:
    """Call `module:factory(**kwargs)` and check that it returns an nn.Module."""
    module_name, attr = path.split(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"model.source: cannot import '{path}': {exc}") from None
    try:
        model = factory(**kwargs)
    except TypeError as exc:
        raise UserError(f"model.kwargs: {path} rejected its arguments: {exc}") from None
    if not isinstance(model, nn.Module):
        raise UserError(f"model.source: {path} returned {type(model).__name__}, not an nn.Module")
    return model.eval()


def load_weights(model: nn.Module, path: str) -> None:
    """Load a safetensors or weights-only torch checkpoint into `model` (strict)."""
    path_obj = Path(path).expanduser()
    try:
        if path_obj.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path_obj))
        else:
            state = torch.load(path_obj, map_location="cpu", weights_only=True)
            state = state.get("state_dict", state.get("model", state))
    except Exception as exc:
        raise UserError(f"model.checkpoint: cannot read '{path}': {exc}") from None
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise UserError(
            f"model.checkpoint: '{path}' does not fit the model "
            f"({len(result.missing_keys)} missing, {len(result.unexpected_keys)} unexpected keys, "
            f"e.g. {(result.missing_keys + result.unexpected_keys)[0]})"
        )



"""Model sources: Hugging Face sequence classifiers and `module:factory` nn.Modules.

Weights load without pickle (safetensors, or `torch.load(weights_only=True)`).
A model is saved by a stage as a folder that `load_saved` reads back.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.errors import UserError
from compress.sources import ModelSource

STRUCTURE = "structure.json"


@dataclass
class ModelBundle:
    """The current model with what it needs to run: tokenizer, labels, input shape."""

    model: nn.Module
    kind: str  # "hf" or "factory"
    label_names: list[str]
    tokenizer: Any = None
    factory: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    input_shape: list[int] = field(default_factory=list)
    structure: dict[str, Any] | None = None  # shapes after structured pruning (to rebuild)
    lm: dict[str, Any] | None = None  # causal LMs: weight scheme, dtype, provenance

    @property
    def is_text(self) -> bool:
        return self.tokenizer is not None


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
        bundle = _load_hf(source.location, label_names)
    if checkpoint:
        load_weights(bundle.model, checkpoint)
    return bundle


def _load_hf(location: str, label_names: list[str], weights: bool = True) -> ModelBundle:
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


def save_model(bundle: ModelBundle, folder: Path) -> Path:
    """Write the model into `folder` (weights as safetensors); return the weights file."""
    folder.mkdir(parents=True, exist_ok=True)
    if bundle.kind == "pt2e":  # a quantized exported program
        from compress.quantization import save_quantized

        return save_quantized(bundle, folder)
    if bundle.kind == "causal-lm":
        from compress.lm_models import save_lm

        return save_lm(bundle, folder)
    if bundle.structure is not None:
        (folder / STRUCTURE).write_text(json.dumps(bundle.structure, indent=2))
    if bundle.kind == "hf":
        bundle.model.save_pretrained(folder, safe_serialization=True)
        bundle.tokenizer.save_pretrained(folder)
        return folder / "model.safetensors"
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in bundle.model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    meta = {"factory": bundle.factory, "kwargs": bundle.kwargs,
            "label_names": bundle.label_names, "input_shape": bundle.input_shape}
    (folder / "model.json").write_text(json.dumps(meta, indent=2))
    return folder / "model.safetensors"


def load_saved(folder: Path) -> ModelBundle:
    """Read back a folder written by `save_model`."""
    if (folder / "model.pt2").is_file():
        from compress.quantization import load_quantized

        return load_quantized(folder)
    if (folder / "causal_lm.json").is_file():
        from compress.lm_models import load_lm

        return load_lm(folder)
    structure_file = folder / STRUCTURE
    structure = json.loads(structure_file.read_text()) if structure_file.is_file() else None
    meta_file = folder / "model.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        model = build_factory(meta["factory"], meta["kwargs"])
        bundle = ModelBundle(model, "factory", meta["label_names"], factory=meta["factory"],
                             kwargs=meta["kwargs"], input_shape=meta["input_shape"])
    else:
        config = json.loads((folder / "config.json").read_text())
        labels = config.get("id2label") or {
            str(i): f"LABEL_{i}" for i in range(config.get("num_labels", 2))}
        names = [labels[k] for k in sorted(labels, key=int)]
        bundle = _load_hf(str(folder), names, weights=structure is None)
    if structure is not None:  # shrink the fresh model to the pruned shapes, then load
        from compress.pruning import apply_structure

        apply_structure(bundle.model, structure)
        bundle.structure = structure
        load_weights(bundle.model, str(folder / "model.safetensors"))
    elif bundle.kind == "factory":
        load_weights(bundle.model, str(folder / "model.safetensors"))
    return bundle


def count_params(model: nn.Module) -> int:
    """Number of parameters, with the packed weights that modules keep as `qweight` buffers
    (int8_grouped's)."""
    packed = sum(b.numel() for name, b in model.named_buffers() if name.endswith("qweight"))
    return sum(p.numel() for p in model.parameters()) + packed


def sparsity(model: nn.Module) -> float:
    """Share of exact zeros over the weight matrices and kernels (tensors with 2+ dims)."""
    zeros = total = 0
    for p in model.parameters():
        if p.dim() >= 2:
            zeros += int((p == 0).sum())
            total += p.numel()
    return zeros / total if total else 0.0


def state_bytes(model: nn.Module) -> int:
    """Bytes of the model's tensors (its size as a weights file, give or take the header)."""
    sizes = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    return sum(sizes.values())

"""A stage's model folder: `save_model` writes every model form (a Hugging Face classifier,
a `module:factory` model, a pruned one at its new shapes, a PT2E int8 program, a causal
LM, a sentence encoder, a cross-encoder) and `load_saved` reads any of them back;
`load_export` reads an export folder."""

from __future__ import annotations

import json
from pathlib import Path

from compress.models.bundle import ModelBundle
from compress.models.loading import build_factory, load_hf_classifier, load_weights
from export.folder import load_export as load_export_folder

STRUCTURE = "structure.json"


def save_model(bundle: ModelBundle, folder: Path) -> Path:
    """Write the model into `folder` (weights as safetensors); return the weights file."""
    folder.mkdir(parents=True, exist_ok=True)
    if bundle.kind == "pt2e":  # a quantized exported program
        from compress.models.graph_model import save_quantized

        return save_quantized(bundle, folder)
    if bundle.kind == "causal-lm":  # the family's own folder (compress.recipe.family_specs)
        from compress.recipe.family_specs import part

        return part("causal-lm", "folder").save_causal_lm(bundle, folder)
    if bundle.kind == "embedding":  # a sentence-transformers folder
        from compress.recipe.family_specs import part

        return part("embedding", "folder").save_encoder(bundle, folder)
    if bundle.kind == "reranker":  # a sentence-transformers CrossEncoder folder
        from compress.recipe.family_specs import part

        return part("reranking", "folder").save_cross_encoder(bundle, folder)
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
        from compress.models.graph_model import load_quantized

        return load_quantized(folder)
    if (folder / "causal_lm.json").is_file():
        from compress.recipe.family_specs import part

        return part("causal-lm", "folder").load_causal_lm_folder(folder)
    if _is_cross_encoder(folder):  # before modules.json: v6 writes one for it too
        from compress.recipe.family_specs import part

        return part("reranking", "folder").load_reranker_folder(folder)
    if (folder / "modules.json").is_file():  # a sentence-transformers folder
        from compress.recipe.family_specs import part

        return part("embedding", "folder").load_encoder_folder(folder)
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
        bundle = load_hf_classifier(str(folder), names, weights=structure is None)
    if structure is not None:  # shrink the fresh model to the pruned shapes, then load
        from compress.models.structure import apply_structure

        apply_structure(bundle.model, structure)
        bundle.structure = structure
        load_weights(bundle.model, str(folder / "model.safetensors"))
    elif bundle.kind == "factory":
        load_weights(bundle.model, str(folder / "model.safetensors"))
    return bundle


def _is_cross_encoder(folder: Path) -> bool:
    """Whether `folder` holds a CrossEncoder as sentence-transformers 6 writes it."""
    try:
        marker = json.loads((folder / "config_sentence_transformers.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(marker, dict) and marker.get("model_type") == "CrossEncoder"


def load_export(folder: str | Path, threads: int | None = None) -> ModelBundle:
    """An export folder's file in its own runtime, as a "runtime" bundle."""
    loaded = load_export_folder(folder, threads)
    return ModelBundle(loaded.model, "runtime", loaded.label_names, tokenizer=loaded.tokenizer,
                       input_shape=loaded.input_shape)

"""Embedding models as pipeline models: the recipe's sentence-transformers folder read into a
`ModelBundle` (kind "embedding"), and a stage's model written back as a sentence-transformers
folder (`modules.json`, `1_Pooling/config.json`, its Dense modules, `Normalize` when it
normalizes, and `config_sentence_transformers.json` with its prompts, truncate_dim and
Matryoshka widths), so that sentence-transformers itself loads what any stage made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from compress.errors import UserError
from compress.families.embedding.encoder import SentenceEncoder, build_encoder, load_encoder
from compress.families.embedding.layout import CONFIG, LEGACY, read_layout
from compress.models.bundle import ModelBundle

KIND = "embedding"  # ModelBundle.kind of a float sentence encoder
MODULES = "modules.json"
STRUCTURE = "structure.json"  # shapes after structured pruning (compress.models.structure)
_ST = "sentence_transformers.models"


def load_recipe_encoder(location: str, checkpoint: str | None = None) -> ModelBundle:
    """The recipe's sentence-transformers model (a folder, or a hub id's cached folder)."""
    from compress.models.loading import load_weights

    try:
        encoder, tokenizer, _ = load_encoder(Path(location))
    except (OSError, ValueError) as exc:
        raise UserError(f"model.source: cannot load '{location}' as a sentence-transformers "
                        f"model: {str(exc).splitlines()[0]}") from None
    if checkpoint:
        load_weights(encoder.transformer, checkpoint)
    return ModelBundle(encoder, KIND, [], tokenizer=tokenizer)


def save_encoder(bundle: ModelBundle, folder: Path) -> Path:
    """Write a sentence encoder into `folder` as a sentence-transformers folder; return its
    weights file."""
    encoder: SentenceEncoder = bundle.model
    folder.mkdir(parents=True, exist_ok=True)
    encoder.transformer.save_pretrained(folder, safe_serialization=True)
    bundle.tokenizer.save_pretrained(folder)
    if bundle.structure is not None:
        (folder / STRUCTURE).write_text(json.dumps(bundle.structure, indent=2))
    modules = [{"path": "", "type": f"{_ST}.Transformer"},
               {"path": "1_Pooling", "type": f"{_ST}.Pooling"}]
    write_module(folder / "1_Pooling", pooling_config(encoder.modes, encoder.config.hidden_size))
    for dense in encoder.dense:
        path = f"{len(modules)}_Dense"
        modules.append({"path": path, "type": f"{_ST}.Dense"})
        write_dense(dense, folder / path)
    if encoder.normalize:
        modules.append({"path": f"{len(modules)}_Normalize", "type": f"{_ST}.Normalize"})
        (folder / modules[-1]["path"]).mkdir(exist_ok=True)
    (folder / MODULES).write_text(json.dumps(
        [{"idx": i, "name": str(i), **m} for i, m in enumerate(modules)], indent=2))
    (folder / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": encoder.max_seq_length or encoder.config.max_position_embeddings,
         "do_lower_case": False}, indent=2))
    config = {"prompts": encoder.prompts, "default_prompt_name": encoder.default_prompt_name,
              "truncate_dim": encoder.truncate_dim, "matryoshka": encoder.matryoshka or None,
              "matryoshka_dims": list(encoder.matryoshka_dims) or None}
    config = {key: value for key, value in config.items() if value}
    if config:
        (folder / CONFIG).write_text(json.dumps(config, indent=2))
    return folder / "model.safetensors"


def pooling_config(modes: tuple[str, ...], width: int) -> dict[str, Any]:
    """sentence-transformers' Pooling config for `modes`: one flag per mode, as every version
    reads it, where the flags' fixed order concatenates them in this order; else (several
    modes in another order) v6's `pooling_mode` list."""
    legacy = [mode for mode in LEGACY.values() if mode in modes]
    if legacy == list(modes):
        return {"word_embedding_dimension": width,
                **{key: mode in modes for key, mode in LEGACY.items()}}
    return {"embedding_dimension": width, "include_prompt": True,
            "pooling_mode": [{"mean_sqrt_len": "mean_sqrt_len_tokens"}.get(m, m)
                             for m in modes]}


def write_module(folder: Path, config: dict[str, Any]) -> None:
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def write_dense(dense: torch.nn.Module, folder: Path) -> None:
    """A Dense module's folder as sentence-transformers writes it (config and weights)."""
    from safetensors.torch import save_file

    linear = dense.linear
    write_module(folder, {
        "in_features": linear.in_features, "out_features": linear.out_features,
        "bias": linear.bias is not None, "use_residual": dense.use_residual,
        "activation_function": f"torch.nn.{type(dense.activation).__name__}"})
    save_file({k: v.contiguous() for k, v in dense.state_dict().items()},
              str(folder / "model.safetensors"))


def load_encoder_folder(folder: Path) -> ModelBundle:
    """Read back a folder written by `save_encoder` (at its pruned shapes, where it was
    pruned)."""
    structure_file = folder / STRUCTURE
    if not structure_file.is_file():
        encoder, tokenizer, _ = load_encoder(folder)
        return ModelBundle(encoder, KIND, [], tokenizer=tokenizer)
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from compress.models.loading import load_weights
    from compress.models.structure import apply_structure

    layout = read_layout(folder)
    structure = json.loads(structure_file.read_text())
    transformer = AutoModel.from_config(AutoConfig.from_pretrained(folder))
    encoder = build_encoder(transformer, layout)
    apply_structure(encoder, structure)  # its names are the encoder's (transformer.*)
    load_weights(transformer, str(folder / "model.safetensors"))
    return ModelBundle(encoder, KIND, [], tokenizer=AutoTokenizer.from_pretrained(folder),
                       structure=structure)


def provenance(bundle: ModelBundle) -> dict[str, Any]:
    """What the manifest keeps of the model, and a server of it needs: pooling,
    normalization, width, longest input, whether it declares Matryoshka training, and
    (where the folder has them) its prompts, default prompt, truncate_dim and Matryoshka
    widths."""
    encoder: SentenceEncoder = bundle.model
    facts = {"pooling": encoder.pooling, "normalize": encoder.normalize,
             "dimensions": encoder.dimensions,
             "max_seq_length": encoder.max_seq_length or encoder.config.max_position_embeddings,
             "matryoshka": encoder.matryoshka}
    optional = {"prompts": encoder.prompts, "default_prompt_name": encoder.default_prompt_name,
                "truncate_dim": encoder.truncate_dim,
                "matryoshka_dims": list(encoder.matryoshka_dims)}
    return {**facts, **{key: value for key, value in optional.items() if value}}

"""Embedding models as pipeline models: the recipe's sentence-transformers folder read into a
`ModelBundle` (kind "embedding"), and a stage's model written back as a sentence-transformers
folder (`modules.json`, `1_Pooling/config.json`, `2_Normalize` when it normalizes), so that
sentence-transformers itself loads what any stage made."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compress.errors import UserError
from compress.families.embedding.encoder import (
    MODES,
    SentenceEncoder,
    load_encoder,
    pooling_key,
)
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
    modules = [{"idx": 0, "name": "0", "path": "", "type": f"{_ST}.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": f"{_ST}.Pooling"}]
    if encoder.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": f"{_ST}.Normalize"})
        (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / MODULES).write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        pooling_config(encoder.pooling, encoder.config.hidden_size), indent=2))
    (folder / "sentence_bert_config.json").write_text(json.dumps(
        {"max_seq_length": encoder.max_seq_length or encoder.config.max_position_embeddings,
         "do_lower_case": False}, indent=2))
    if encoder.matryoshka:
        (folder / "config_sentence_transformers.json").write_text(
            json.dumps({"matryoshka": True}, indent=2))
    return folder / "model.safetensors"


def pooling_config(mode: str, width: int) -> dict[str, Any]:
    """sentence-transformers' Pooling config with exactly `mode` on."""
    flags = {pooling_key(m): m == mode for m in MODES}
    return {"word_embedding_dimension": width, **flags}


def load_encoder_folder(folder: Path) -> ModelBundle:
    """Read back a folder written by `save_encoder` (at its pruned shapes, where it was
    pruned)."""
    structure_file = folder / STRUCTURE
    if not structure_file.is_file():
        encoder, tokenizer, _ = load_encoder(folder)
        return ModelBundle(encoder, KIND, [], tokenizer=tokenizer)
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from compress.families.embedding.encoder import read_layout
    from compress.models.loading import load_weights
    from compress.models.structure import apply_structure

    layout = read_layout(folder)
    structure = json.loads(structure_file.read_text())
    transformer = AutoModel.from_config(AutoConfig.from_pretrained(folder))
    encoder = SentenceEncoder(transformer, layout.pooling, layout.normalize,
                              layout.max_seq_length, layout.matryoshka).eval()
    apply_structure(encoder, structure)  # its names are the encoder's (transformer.*)
    load_weights(transformer, str(folder / "model.safetensors"))
    return ModelBundle(encoder, KIND, [], tokenizer=AutoTokenizer.from_pretrained(folder),
                       structure=structure)


def provenance(bundle: ModelBundle) -> dict[str, Any]:
    """What the manifest keeps of the model, and a server of it needs: pooling,
    normalization, width, longest input, and whether it declares Matryoshka training."""
    encoder = bundle.model
    return {"pooling": encoder.pooling, "normalize": encoder.normalize,
            "dimensions": encoder.config.hidden_size,
            "max_seq_length": encoder.max_seq_length or encoder.config.max_position_embeddings,
            "matryoshka": encoder.matryoshka}

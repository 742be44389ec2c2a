"""Causal LMs as pipeline models: loading a recipe's model (folder, hub id or GGUF) into a
`ModelBundle`, and saving / reading back a stage's model folder.

A saved folder is a plain Hugging Face folder (config, tokenizer, safetensors) plus
`causal_lm.json`: the weight scheme, activation dtype, compile mode and provenance. A
weight-quantized model keeps torchao's tensors in `model.pt` (read with
`torch.load(weights_only=True)`): plain transformers + torchao rebuild it by applying the
same `quantize_` config to the architecture and loading that state dict.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from compress.errors import UserError
from compress.models.bundle import ModelBundle
from serve.causal_lm.runtime.loading import CAUSAL_LM_FILE, DTYPES  # noqa: F401  (one definition)


def load_recipe_causal_lm(location: str, checkpoint: str | None = None) -> ModelBundle:
    """The recipe's causal LM (a GGUF file dequantized to float32, a folder, or an id)."""
    from compress.families.causal_lm.model import load_causal_lm
    from compress.models.loading import load_weights

    try:
        lm = load_causal_lm(location)
    except (OSError, ValueError) as exc:
        raise UserError(f"model.source: cannot load '{location}' as a causal LM: "
                        f"{str(exc).splitlines()[0]}") from None
    if checkpoint:
        load_weights(lm.model, checkpoint)
    facts = {"scheme": None, "dtype": "float32", "provenance": lm.provenance}
    return ModelBundle(lm.model, "causal-lm", [], tokenizer=lm.tokenizer, causal_lm_facts=facts)


def save_causal_lm(bundle: ModelBundle, folder: Path) -> Path:
    """Write a causal LM into `folder`; return its weights file."""
    folder.mkdir(parents=True, exist_ok=True)
    facts = dict(bundle.causal_lm_facts or {})
    bundle.tokenizer.save_pretrained(folder)
    if facts.get("scheme"):
        bundle.model.config.save_pretrained(folder)
        if getattr(bundle.model, "generation_config", None) is not None:
            bundle.model.generation_config.save_pretrained(folder)  # its stop tokens
        weights = folder / "model.pt"
        torch.save(bundle.model.state_dict(), weights)
    else:
        bundle.model.save_pretrained(folder, safe_serialization=True)
        weights = folder / "model.safetensors"
    (folder / CAUSAL_LM_FILE).write_text(json.dumps(facts, indent=2))
    return weights


def load_causal_lm_folder(folder: Path) -> ModelBundle:
    """Read back a folder written by `save_causal_lm` (through the standalone runtime that exports
    and archives ship, so both read a folder the same way)."""
    from serve.causal_lm.runtime.loading import load_folder

    lm = load_folder(folder)
    return ModelBundle(lm.model, "causal-lm", [], tokenizer=lm.tokenizer, causal_lm_facts=lm.facts)


def provenance(bundle: ModelBundle) -> dict[str, Any]:
    """Where the weights came from (for the manifest)."""
    return dict((bundle.causal_lm_facts or {}).get("provenance") or {})

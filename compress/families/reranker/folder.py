"""Rerankers as pipeline models: a sentence-transformers `CrossEncoder` folder read into a
`ModelBundle` (kind "reranker") whose module gives each (query, document) pair its final
score, and a stage's model written back as a folder that `CrossEncoder(folder)` loads.

What sentence-transformers writes, and what is read of it:
- v6: a Hugging Face sequence-classification folder (config.json, weights, tokenizer) with
  `config_sentence_transformers.json` (`"model_type": "CrossEncoder"`, `"activation_fn":
  "torch.nn.modules.activation.Sigmoid"`, prompts), `modules.json` (one Transformer at path
  "") and `sentence_bert_config.json` (`"transformer_task": "sequence-classification"`);
- before v6: a plain Hugging Face folder whose config.json may say
  `"sentence_transformers": {"activation_fn": ...}`.

`CrossEncoder.predict(pairs)` is activation(logits)[:, 0] for a one-label model, the
activation being the folder's, else Sigmoid; pairs tokenized as `tokenizer(query, document)`
cut longest-first at the model's max length (`sentence_bert_config.json`'s
`max_seq_length` where it has one, else the tokenizer's `model_max_length` capped at the
position table; a folder written here keeps it in the tokenizer, as v6 does). A model with
several labels, an activation outside `torch.nn`, or prompts (put before the query, which
this family does not do yet) is refused in one line. A bare encoder (no classification head,
e.g. all-MiniLM-L6-v2) gets a new one-label head, as `CrossEncoder(encoder)` gives it:
untrained, seeded by the caller, for trying the chain offline.

A structurally pruned model's folder also holds `structure.json`, its new shapes (names
relative to the sequence classifier; its config.json keeps the unpruned widths, so only
compress reads such a folder back, as with a pruned classifier or sentence encoder).
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.errors import UserError
from compress.models.bundle import ModelBundle

KIND = "reranker"  # ModelBundle.kind of a float cross-encoder
ST_CONFIG = "config_sentence_transformers.json"
MODEL_TYPE = "CrossEncoder"
DEFAULT_ACTIVATION = "Sigmoid"  # sentence-transformers' for a one-label model
HUGE = 1_000_000  # a tokenizer's model_max_length past this is "no limit said"
STRUCTURE = "structure.json"  # shapes after structured pruning (compress.models.structure)


class CrossEncoderScorer(nn.Module):
    """A sequence classifier with one label and the folder's activation: token ids of
    (query, document) pairs in, one score per pair out (shape (batch,)), as `predict`."""

    output_name = "score"  # the name of an exported graph's output

    def __init__(self, classifier: nn.Module, activation: str = DEFAULT_ACTIVATION,
                 max_length: int | None = None):
        super().__init__()
        self.classifier = classifier
        self.activation = activation_module(activation)
        self.max_length = max_length
        self.config = classifier.config  # what the shared code reads (max_position_embeddings)
        # DistilBERT and ModernBERT take no token types: they are not passed to them
        self.takes_token_types = "token_type_ids" in inspect.signature(
            classifier.forward).parameters

    @property
    def base_model(self) -> nn.Module:
        """The classifier's encoder (where layer-level code finds `encoder.layer`)."""
        return self.classifier.base_model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        extra = ({"token_type_ids": token_type_ids}
                 if self.takes_token_types and token_type_ids is not None else {})
        logits = self.classifier(input_ids=input_ids, attention_mask=attention_mask,
                                 **extra).logits
        return self.activation(logits[:, 0])


def activation_module(name: str) -> nn.Module:
    """`torch.nn`'s module of that name (a dotted path: its last part)."""
    short = name.rsplit(".", 1)[-1]
    module = getattr(nn, short, None)
    if not (isinstance(module, type) and issubclass(module, nn.Module)):
        raise UserError(f"model.source: the cross-encoder's activation_fn {name!r} is not a "
                        "torch.nn module; this family applies torch.nn activations only")
    return module()


def activation_path(module: nn.Module) -> str:
    """The dotted path sentence-transformers writes for an activation module."""
    return f"{type(module).__module__}.{type(module).__name__}"


def is_cross_encoder(folder: Path) -> bool:
    """Whether `folder` is a CrossEncoder folder as sentence-transformers 6 writes it."""
    try:
        return json.loads((folder / ST_CONFIG).read_text()).get("model_type") == MODEL_TYPE
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def read_facts(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The folder's activation and prompts (v6's config_sentence_transformers.json, else
    config.json's `sentence_transformers` block), and its `max_seq_length` where said."""
    st_config: dict[str, Any] = {}
    if (folder / ST_CONFIG).is_file():
        st_config = json.loads((folder / ST_CONFIG).read_text())
    legacy = config.get("sentence_transformers") or {}
    activation = (st_config.get("activation_fn") or legacy.get("activation_fn")
                  or DEFAULT_ACTIVATION)
    bert_config = folder / "sentence_bert_config.json"
    max_seq = (json.loads(bert_config.read_text()).get("max_seq_length")
               if bert_config.is_file() else None)
    return {"activation": activation, "prompts": st_config.get("prompts") or {},
            "max_seq_length": max_seq}


def load_cross_encoder(location: str | Path, checkpoint: str | None = None) -> ModelBundle:
    """A CrossEncoder folder (v6 or older) as a float32 reranker bundle."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    folder = Path(location)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"model.source: cannot read {folder / 'config.json'} as a "
                        f"cross-encoder's config ({type(exc).__name__})") from None
    headed = any(str(a).endswith("ForSequenceClassification")
                 for a in config.get("architectures") or [])
    labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 2)
    if headed and labels != 1:
        raise UserError(f"model.source: a reranker gives one score a pair; this model has "
                        f"{labels} labels (a classifier: model.task classification)")
    facts = read_facts(folder, config)
    if facts["prompts"]:
        raise UserError(f"model.source: the cross-encoder has prompts "
                        f"({', '.join(sorted(facts['prompts']))}), which this family does "
                        "not put before the query yet; remove them from "
                        f"{ST_CONFIG} to score without them")
    hf_logging.set_verbosity_error()
    structure = read_structure(folder)
    try:
        if structure is None:
            classifier = AutoModelForSequenceClassification.from_pretrained(
                folder, dtype=torch.float32, **({} if headed else {"num_labels": 1})).eval()
        else:
            classifier = pruned_classifier(folder, structure)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as exc:
        raise UserError(f"model.source: cannot load '{location}' as a cross-encoder: "
                        f"{str(exc).splitlines()[0]}") from None
    if checkpoint:
        from compress.models.loading import load_weights

        load_weights(classifier, checkpoint)
    scorer = CrossEncoderScorer(classifier, facts["activation"],
                                max_length_of(facts, tokenizer, classifier.config))
    return ModelBundle(scorer.eval(), KIND, ["score"], tokenizer=tokenizer, structure=structure)


def read_structure(folder: Path) -> dict[str, Any] | None:
    """The shapes a structured prune left (`STRUCTURE`, written beside the weights), else
    None."""
    path = folder / STRUCTURE
    return json.loads(path.read_text()) if path.is_file() else None


def pruned_classifier(folder: Path, structure: dict[str, Any]) -> nn.Module:
    """The folder's sequence classifier built from its config, shrunk to the pruned shapes
    (names relative to the classifier), then its weights loaded."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from compress.models.loading import load_weights
    from compress.models.structure import apply_structure

    classifier = AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(folder))
    apply_structure(classifier, structure)
    load_weights(classifier, str(folder / "model.safetensors"))
    return classifier.float().eval()


def max_length_of(facts: dict[str, Any], tokenizer: Any, config: Any) -> int:
    """The longest pair the model reads, as CrossEncoder finds it: the folder's
    `max_seq_length`, else the tokenizer's `model_max_length` capped at the position
    table."""
    if facts.get("max_seq_length"):
        return int(facts["max_seq_length"])
    positions = int(getattr(config, "max_position_embeddings", None) or HUGE)
    limit = getattr(tokenizer, "model_max_length", None) or HUGE
    return int(min(limit, positions)) if min(limit, positions) < HUGE else 512


def save_cross_encoder(bundle: ModelBundle, folder: Path) -> Path:
    """Write a reranker into `folder` as sentence-transformers 6 writes a CrossEncoder;
    return its weights file."""
    scorer: CrossEncoderScorer = bundle.model
    folder.mkdir(parents=True, exist_ok=True)
    scorer.classifier.save_pretrained(folder, safe_serialization=True)
    if bundle.structure is not None:  # config.json keeps the unpruned widths
        (folder / STRUCTURE).write_text(json.dumps(bundle.structure, indent=2))
    bundle.tokenizer.model_max_length = scorer.max_length  # where v6 keeps it
    bundle.tokenizer.save_pretrained(folder)
    (folder / ST_CONFIG).write_text(json.dumps(
        {"model_type": MODEL_TYPE, "activation_fn": activation_path(scorer.activation),
         "prompts": {}, "default_prompt_name": None}, indent=2))
    (folder / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "",
          "type": "sentence_transformers.base.modules.transformer.Transformer"}], indent=2))
    (folder / "sentence_bert_config.json").write_text(json.dumps(
        {"transformer_task": "sequence-classification",
         "modality_config": {"text": {"method": "forward", "method_output_name": "logits"}},
         "module_output_name": "scores"}, indent=2))
    return folder / "model.safetensors"


def load_reranker_folder(folder: Path) -> ModelBundle:
    """Read back a folder written by `save_cross_encoder` (at its pruned shapes, where it
    was pruned)."""
    return load_cross_encoder(folder)


def provenance(bundle: ModelBundle) -> dict[str, Any]:
    """What the manifest keeps of the model, and a server of it needs: its activation and
    longest pair."""
    scorer: CrossEncoderScorer = bundle.model
    return {"activation": type(scorer.activation).__name__,
            "max_seq_length": scorer.max_length}

"""What a sentence-transformers folder says of its model, read from its own files in every
layout sentence-transformers has written (v2 to v6), without importing it.

- `modules.json` lists the modules in order. Their class is the last part of each `type`
  (`sentence_transformers.models.Pooling` before v5,
  `sentence_transformers.sentence_transformer.modules.pooling.Pooling` in v6); a type outside
  `sentence_transformers` is a custom class, refused.
- Transformer: in the root (`path: ""`) or a subfolder (`0_Transformer` in v2). Its
  `max_seq_length` is `sentence_bert_config.json`'s where it has one (before v6), else the
  tokenizer's `model_max_length` capped at the model's `max_position_embeddings`, as
  sentence-transformers 6 computes it on load.
- Pooling: v6 writes `"pooling_mode": "mean"` or a list of modes whose results are
  concatenated in that order, `embedding_dimension` and `include_prompt`; older versions one
  `pooling_mode_*` flag per mode (several on: concatenated in the fixed order of `LEGACY`;
  none on: mean, as sentence-transformers reads it) and `word_embedding_dimension`.
- Dense (any number, after pooling): `config.json` (in/out features, bias, activation by its
  dotted name, `use_residual`) and the weights in `model.safetensors` or `pytorch_model.bin`.
- Normalize (last), Dropout (nothing at inference).
- `config_sentence_transformers.json`: `prompts`, `default_prompt_name`, `truncate_dim`, and
  compress's own `matryoshka` / `matryoshka_dims` (sentence-transformers writes no key for
  Matryoshka training; the model card's MatryoshkaLoss parameters say it too).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compress.errors import UserError

# compress's pooling modes, in the order older sentence-transformers concatenated them
MODES = ("cls", "max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken")
LEGACY = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
          "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
          "pooling_mode_weightedmean_tokens": "weightedmean",
          "pooling_mode_lasttoken": "lasttoken"}
V6_NAMES = {"mean_sqrt_len_tokens": "mean_sqrt_len"}  # v6's spelling -> compress's
# torch.nn activations a Dense module may name (sentence-transformers writes the class's
# dotted name, e.g. torch.nn.modules.activation.Tanh)
ACTIVATIONS = ("Tanh", "Identity", "ReLU", "GELU", "Sigmoid", "SiLU", "LeakyReLU", "ELU",
               "Softplus", "Mish", "Hardtanh", "Softsign")
MODULES = ("Transformer", "Pooling", "Dense", "Normalize", "Dropout")
CONFIG = "config_sentence_transformers.json"
WEIGHTS = ("model.safetensors", "pytorch_model.bin")
SENTENCE = "sentence_embedding"  # the features key that post-pooling modules read and write


@dataclass(frozen=True)
class DenseLayer:
    """One Dense module after pooling: activation(linear(x)) (+ a residual)."""

    folder: Path
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "Tanh"  # a torch.nn class name (ACTIVATIONS)
    residual: bool = False


@dataclass(frozen=True)
class EncoderLayout:
    """What a sentence-transformers folder says of its model."""

    transformer: Path  # the Hugging Face model's folder
    pooling: tuple[str, ...]  # MODES, concatenated in this order
    normalize: bool
    max_seq_length: int | None
    matryoshka: bool = False  # trained so that a prefix of the embedding is one too
    dense: tuple[DenseLayer, ...] = ()
    prompts: dict[str, str] = field(default_factory=dict)  # name -> text put before a text
    default_prompt_name: str | None = None  # the prompt used when none is named
    truncate_dim: int | None = None  # the embedding's default width (its first values)
    matryoshka_dims: tuple[int, ...] = ()  # the widths it was trained at, widest first


def read_layout(folder: Path) -> EncoderLayout:
    """The layout of a sentence-transformers folder; UserError (one line, naming the module)
    for what it lacks or asks for that compress cannot do."""
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        raise UserError(f"{folder}: no modules.json; an embedding model is a "
                        "sentence-transformers folder (modules.json, a Pooling module)")
    modules = [(module_kind(folder, m), folder / m.get("path", ""))
               for m in json.loads(modules_file.read_text())]
    kinds = [kind for kind, _ in modules]
    if kinds[:2] != ["Transformer", "Pooling"]:
        raise UserError(f"{modules_file}: modules {kinds}: a Transformer then a Pooling "
                        "module must come first")
    if "Normalize" in kinds and kinds.index("Normalize") != len(kinds) - 1:
        raise UserError(f"{modules_file}: a module after Normalize ({kinds}) is not supported")
    transformer, pooling_folder = modules[0][1], modules[1][1]
    pooling, include_prompt = read_pooling(pooling_folder)
    config = read_json(folder / CONFIG)
    prompts = config.get("prompts") or {}
    if prompts and not include_prompt:
        raise UserError(f"{pooling_folder}/config.json: include_prompt false (pooling without "
                        "the prompt's tokens) is not supported")
    dense = tuple(read_dense(path) for kind, path in modules if kind == "Dense")
    for path in (p for kind, p in modules[2:] if kind != "Dropout"):
        check_reads_sentence(path)
    matryoshka = declares_matryoshka(folder)
    return EncoderLayout(
        transformer, pooling, "Normalize" in kinds, max_seq_length(transformer), matryoshka,
        dense, dict(prompts), config.get("default_prompt_name"), config.get("truncate_dim"),
        declared_dims(folder) if matryoshka else ())


def module_kind(folder: Path, module: dict[str, Any]) -> str:
    """The sentence-transformers class a modules.json entry names; UserError for another."""
    kind = str(module.get("type", ""))
    name = kind.rsplit(".", 1)[-1]
    if not kind.startswith("sentence_transformers.") or name not in MODULES:
        where = folder / module.get("path", "")
        raise UserError(f"{where}: module {kind or '(no type)'} is not supported (compress "
                        f"reads sentence-transformers' {', '.join(MODULES)})")
    return name


def read_json(file: Path) -> dict[str, Any]:
    return json.loads(file.read_text()) if file.is_file() else {}


def read_pooling(folder: Path) -> tuple[tuple[str, ...], bool]:
    """(the pooling modes in concatenation order, include_prompt) of a Pooling module."""
    config = read_json(folder / "config.json")
    named = config.get("pooling_mode")
    if named is None:  # before v6: a flag per mode; none on reads as mean
        modes = tuple(mode for key, mode in LEGACY.items() if config.get(key)) or ("mean",)
    else:
        names = [named] if isinstance(named, str) else list(named)
        modes = tuple(V6_NAMES.get(n, n) for n in names)
        unknown = [n for n, mode in zip(names, modes, strict=True) if mode not in MODES]
        if unknown or not modes:
            raise UserError(f"{folder}/config.json: pooling_mode {named!r} is not supported "
                            f"(one or a list of {', '.join(V6_NAMES.get(m, m) for m in MODES)})")
    return modes, bool(config.get("include_prompt", True))


def read_dense(folder: Path) -> DenseLayer:
    """A Dense module's shape and activation; UserError for an activation outside torch.nn's
    or weights that are missing."""
    config = read_json(folder / "config.json")
    activation = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
    name = activation.rsplit(".", 1)[-1]
    if not activation.startswith("torch.nn.") or name not in ACTIVATIONS:
        raise UserError(f"{folder}: Dense activation {activation} is not supported (one of "
                        f"torch.nn's {', '.join(ACTIVATIONS)})")
    if not any((folder / weights).is_file() for weights in WEIGHTS):
        raise UserError(f"{folder}: Dense module without weights ({' or '.join(WEIGHTS)})")
    return DenseLayer(folder, int(config["in_features"]), int(config["out_features"]),
                      bool(config.get("bias", True)), name, bool(config.get("use_residual")))


def check_reads_sentence(folder: Path) -> None:
    """UserError where a module after pooling reads or writes another features key than the
    sentence embedding (v6's module_input_name / module_output_name)."""
    config = read_json(folder / "config.json")
    for key in ("module_input_name", "module_output_name"):
        if config.get(key, SENTENCE) not in (SENTENCE, None):
            raise UserError(f"{folder}/config.json: {key} {config[key]!r} is not supported "
                            f"(only {SENTENCE!r})")


def max_seq_length(transformer: Path) -> int | None:
    """The longest input sentence-transformers reads: `sentence_bert_config.json`'s
    max_seq_length, else the tokenizer's model_max_length capped at the model's
    max_position_embeddings (what sentence-transformers 6 reports after loading the folder);
    None where neither says."""
    config = read_json(transformer / "sentence_bert_config.json")
    if config.get("do_lower_case"):
        raise UserError(f"{transformer}/sentence_bert_config.json: do_lower_case true is not "
                        "supported (save the tokenizer with lowercasing instead)")
    if config.get("transformer_task", "feature-extraction") != "feature-extraction":
        raise UserError(f"{transformer}/sentence_bert_config.json: transformer_task "
                        f"{config['transformer_task']!r} is not supported (feature-extraction)")
    if config.get("max_seq_length"):
        return int(config["max_seq_length"])
    tokenizer_max = read_json(transformer / "tokenizer_config.json").get("model_max_length")
    positions = read_json(transformer / "config.json").get("max_position_embeddings")
    bounds = [int(v) for v in (tokenizer_max, positions)
              if isinstance(v, int | float) and 0 < v < 1e9]
    return min(bounds) if bounds else None


def declares_matryoshka(folder: Path) -> bool:
    """Whether the folder says its model was trained with sentence-transformers'
    MatryoshkaLoss (its model card names the loss, or `config_sentence_transformers.json`
    has `"matryoshka": true`), so that a shorter prefix of an embedding is usable."""
    if read_json(folder / CONFIG).get("matryoshka") is True:
        return True
    card = folder / "README.md"
    return card.is_file() and "MatryoshkaLoss" in card.read_text(errors="replace")


def declared_dims(folder: Path) -> tuple[int, ...]:
    """The widths a Matryoshka model was trained at, widest first: compress's
    `matryoshka_dims` in `config_sentence_transformers.json`, else the `matryoshka_dims`
    that sentence-transformers' model card writes among MatryoshkaLoss's parameters; () where
    neither says (the measures then halve the width)."""
    dims = read_json(folder / CONFIG).get("matryoshka_dims")
    if dims is None:
        card = folder / "README.md"
        found = re.search(r'"matryoshka_dims":\s*\[([\d,\s]+)\]',
                          card.read_text(errors="replace")) if card.is_file() else None
        dims = [int(d) for d in found.group(1).split(",") if d.strip()] if found else []
    return tuple(sorted({int(d) for d in dims}, reverse=True))

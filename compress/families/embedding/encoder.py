"""A sentence-transformers model as one torch module: the transformer, its pooling and its
normalization read from the folder's own files (`modules.json`, the pooling module's
`config.json`, `sentence_bert_config.json`), so that every stage sees a plain
`nn.Module` whose output is the embedding (no sentence-transformers import).

Pooling modes: `mean` (over the tokens the attention mask keeps), `cls` (the first token),
`max` (over kept tokens), `mean_sqrt_len` (the sum over kept tokens / sqrt(their count)),
`lasttoken` (the last kept token), as sentence-transformers' `Pooling` computes them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from compress.errors import UserError
from compress.families.embedding.packing import packed_forward, use_packed_attention

MODES = ("cls", "mean", "max", "mean_sqrt_len", "lasttoken")


@dataclass(frozen=True)
class EncoderLayout:
    """What a sentence-transformers folder says of its model."""

    transformer: Path  # the Hugging Face model's folder
    pooling: str  # one of MODES
    normalize: bool
    max_seq_length: int | None
    matryoshka: bool = False  # trained so that a prefix of the embedding is one too


def read_layout(folder: Path) -> EncoderLayout:
    """The layout of a sentence-transformers folder; UserError says what is missing."""
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        raise UserError(f"{folder}: no modules.json; an embedding model is a "
                        "sentence-transformers folder (modules.json, a Pooling module)")
    modules = json.loads(modules_file.read_text())
    kinds = {m["type"].rsplit(".", 1)[-1]: folder / m.get("path", "") for m in modules}
    unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unknown:
        raise UserError(f"{folder}: sentence-transformers module {unknown[0]} is not "
                        "supported (Transformer, Pooling and Normalize are)")
    if "Transformer" not in kinds or "Pooling" not in kinds:
        raise UserError(f"{folder}: modules.json needs a Transformer and a Pooling module")
    pooling_config = json.loads((kinds["Pooling"] / "config.json").read_text())
    chosen = [mode for mode in MODES if pooling_config.get(pooling_key(mode))]
    if len(chosen) != 1:
        raise UserError(f"{kinds['Pooling']}/config.json: exactly one pooling mode must be "
                        f"on, found {chosen or 'none'} (one of {', '.join(MODES)})")
    bert_config = kinds["Transformer"] / "sentence_bert_config.json"
    length = (json.loads(bert_config.read_text()).get("max_seq_length")
              if bert_config.is_file() else None)
    return EncoderLayout(kinds["Transformer"], chosen[0], "Normalize" in kinds, length,
                         declares_matryoshka(folder))


def pooling_key(mode: str) -> str:
    """The key of `mode` in sentence-transformers' Pooling config."""
    return {"cls": "pooling_mode_cls_token", "lasttoken": "pooling_mode_lasttoken"}.get(
        mode, f"pooling_mode_{mode}_tokens")


def declares_matryoshka(folder: Path) -> bool:
    """Whether the folder says its model was trained with sentence-transformers'
    MatryoshkaLoss (its model card names the loss, or `config_sentence_transformers.json`
    has `"matryoshka": true`), so that a shorter prefix of an embedding is usable."""
    config = folder / "config_sentence_transformers.json"
    if config.is_file() and json.loads(config.read_text()).get("matryoshka") is True:
        return True
    card = folder / "README.md"
    return card.is_file() and "MatryoshkaLoss" in card.read_text(errors="replace")


class SentenceEncoder(nn.Module):
    """transformer -> pooling -> (normalization): token ids in, one embedding per row.

    The transformer's own pooler (BERT's dense + tanh over the first token), which
    sentence-transformers never reads, is dropped: a captured graph would otherwise carry
    it as dead work (and PT2E's x86 quantizer fails on its unused output)."""

    output_name = "embedding"  # the name of an exported graph's output

    def __init__(self, transformer: nn.Module, pooling: str, normalize: bool,
                 max_seq_length: int | None = None, matryoshka: bool = False):
        super().__init__()
        if pooling not in MODES:
            raise ValueError(f"pooling {pooling!r}: one of {', '.join(MODES)}")
        if getattr(transformer, "pooler", None) is not None:
            transformer.pooler = None
        self.transformer, self.pooling, self.normalize = transformer, pooling, normalize
        self.max_seq_length, self.matryoshka = max_seq_length, matryoshka

    @property
    def config(self):
        """The transformer's config (its position table bounds an export's length)."""
        return self.transformer.config

    @property
    def base_model(self) -> nn.Module:
        """The transformer (where layer-level code finds `encoder.layer`)."""
        return self.transformer

    def packed(self) -> PackedEncoder:
        """A copy of this encoder (weights copied) that computes the real tokens of its
        batch only, in one sequence (`PackedEncoder`); CompressError where compress's
        attention kernel cannot be built here."""
        source = copy.deepcopy(self)
        use_packed_attention(source.transformer)
        return PackedEncoder(source.transformer, source.pooling, source.normalize,
                             source.max_seq_length, source.matryoshka).eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        tokens = self.transformer(input_ids=input_ids, attention_mask=attention_mask,
                                  **extra).last_hidden_state
        pooled = pool(tokens, attention_mask, self.pooling)
        return nn.functional.normalize(pooled, p=2, dim=-1) if self.normalize else pooled


class PackedEncoder(SentenceEncoder):
    """`SentenceEncoder` over the real tokens of its batch only, in one sequence, attention
    within each text on compress's kernel (`packing.py`): called as it, on a padded batch."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return packed_forward(self, input_ids, attention_mask, token_type_ids)


def pool(tokens: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """One vector per row of `tokens` (rows x length x width) over the kept positions."""
    keep = mask.unsqueeze(-1).to(tokens.dtype)
    if mode == "cls":
        return tokens[:, 0]
    if mode == "max":
        return tokens.masked_fill(keep == 0, torch.finfo(tokens.dtype).min).amax(1)
    if mode == "lasttoken":
        last = mask.sum(1).long() - 1  # right-padded rows: the last kept position
        return tokens[torch.arange(tokens.shape[0]), last]
    total = (tokens * keep).sum(1)
    count = keep.sum(1).clamp_min(1e-9)
    return total / (count.sqrt() if mode == "mean_sqrt_len" else count)


def load_encoder(folder: Path) -> tuple[SentenceEncoder, object, EncoderLayout]:
    """(the encoder in eval mode, its tokenizer, its layout) of a sentence-transformers
    folder."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging

    layout = read_layout(folder)
    quiet = logging.get_verbosity()
    logging.set_verbosity_error()  # a folder saved without the unused pooler: no warning
    try:
        transformer = AutoModel.from_pretrained(layout.transformer)
    finally:
        logging.set_verbosity(quiet)
    tokenizer = AutoTokenizer.from_pretrained(layout.transformer)
    encoder = SentenceEncoder(transformer, layout.pooling, layout.normalize,
                              layout.max_seq_length, layout.matryoshka)
    return encoder.eval(), tokenizer, layout

"""A sentence-transformers model as one torch module: the transformer, its pooling, its Dense
modules and its normalization as the folder's own files say (`layout.py`), so that every stage
sees a plain `nn.Module` whose output is the embedding (no sentence-transformers import).

Pooling modes, as sentence-transformers' `Pooling` computes them on a right-padded batch:
`mean` (over the tokens the attention mask keeps), `cls` (the first token), `max` (over kept
tokens), `mean_sqrt_len` (the sum over kept tokens / sqrt(their count)), `weightedmean` (kept
tokens weighted by their position, 1 for the first), `lasttoken` (the last kept token); several
modes are concatenated in the folder's order. Prompts, `truncate_dim` and the Matryoshka widths
ride along as plain attributes: they change the text before tokenizing and the served width,
not the graph.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.families.embedding.layout import (
    MODES,
    WEIGHTS,
    DenseLayer,
    EncoderLayout,
    read_layout,
)
from compress.families.embedding.packing import packed_forward, use_packed_attention


class Dense(nn.Module):
    """sentence-transformers' Dense module: activation(linear(x)), plus x (projected where
    the widths differ) with `residual`; its parameter names are sentence-transformers'."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 activation: str = "Tanh", residual: bool = False):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.activation = getattr(nn, activation)()
        self.use_residual = residual
        if residual and in_features != out_features:
            self.residual = nn.Linear(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (self.residual(x) if hasattr(self, "residual") else x)
        return out


def load_dense(layer: DenseLayer) -> Dense:
    """A Dense module with its folder's weights (safetensors, or a pickle-free torch.load)."""
    module = Dense(layer.in_features, layer.out_features, layer.bias, layer.activation,
                   layer.residual)
    file = next(layer.folder / w for w in WEIGHTS if (layer.folder / w).is_file())
    if file.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(file))
    else:
        state = torch.load(file, map_location="cpu", weights_only=True)
    module.load_state_dict(state)
    return module.eval()


class SentenceEncoder(nn.Module):
    """transformer -> pooling -> Dense modules -> (normalization): token ids in, one
    embedding per row.

    The transformer's own pooler (BERT's dense + tanh over the first token), which
    sentence-transformers never reads, is dropped: a captured graph would otherwise carry
    it as dead work (and PT2E's x86 quantizer fails on its unused output)."""

    output_name = "embedding"  # the name of an exported graph's output

    def __init__(self, transformer: nn.Module, pooling: str | Sequence[str], normalize: bool,
                 max_seq_length: int | None = None, matryoshka: bool = False,
                 dense: Sequence[nn.Module] = (), prompts: dict[str, str] | None = None,
                 default_prompt_name: str | None = None, truncate_dim: int | None = None,
                 matryoshka_dims: Sequence[int] = ()):
        super().__init__()
        modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
        if not modes or any(mode not in MODES for mode in modes):
            raise ValueError(f"pooling {pooling!r}: one or several of {', '.join(MODES)}")
        if getattr(transformer, "pooler", None) is not None:
            transformer.pooler = None
        self.transformer, self.modes, self.normalize = transformer, modes, normalize
        self.dense = nn.Sequential(*dense)
        self.max_seq_length, self.matryoshka = max_seq_length, matryoshka
        self.prompts, self.default_prompt_name = dict(prompts or {}), default_prompt_name
        self.truncate_dim, self.matryoshka_dims = truncate_dim, tuple(matryoshka_dims)

    @property
    def pooling(self) -> str:
        """The pooling modes as one name (`mean`, or `mean+max` for a concatenation)."""
        return "+".join(self.modes)

    @property
    def config(self):
        """The transformer's config (its position table bounds an export's length)."""
        return self.transformer.config

    @property
    def base_model(self) -> nn.Module:
        """The transformer (where layer-level code finds `encoder.layer`)."""
        return self.transformer

    @property
    def dimensions(self) -> int:
        """The width of the embedding: the last Dense module's, else the pooled width."""
        for module in reversed(self.dense):
            return module.linear.out_features
        return len(self.modes) * self.config.hidden_size

    def settings(self) -> dict[str, Any]:
        """Every constructor argument but the transformer (to build a sibling encoder)."""
        return {"pooling": self.modes, "normalize": self.normalize,
                "max_seq_length": self.max_seq_length, "matryoshka": self.matryoshka,
                "dense": list(self.dense), "prompts": self.prompts,
                "default_prompt_name": self.default_prompt_name,
                "truncate_dim": self.truncate_dim, "matryoshka_dims": self.matryoshka_dims}

    def prompt(self, name: str | None = None) -> str:
        """The text put before each text: prompt `name`'s, else the default prompt's, else
        none (sentence-transformers' encode); KeyError for a name the model lacks."""
        name = name or self.default_prompt_name
        return self.prompts[name] if name else ""

    def packed(self) -> PackedEncoder:
        """A copy of this encoder (weights copied) that computes the real tokens of its
        batch only, in one sequence (`PackedEncoder`); CompressError where compress's
        attention kernel cannot be built here."""
        source = copy.deepcopy(self)
        use_packed_attention(source.transformer)
        return PackedEncoder(source.transformer, **source.settings()).eval()

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """The embedding from the pooled vector: the Dense modules, then the normalization."""
        out = self.dense(pooled)
        return nn.functional.normalize(out, p=2, dim=-1) if self.normalize else out

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
        tokens = self.transformer(input_ids=input_ids, attention_mask=attention_mask,
                                  **extra).last_hidden_state
        return self.head(torch.cat([pool(tokens, attention_mask, mode) for mode in self.modes],
                                   dim=-1))


class PackedEncoder(SentenceEncoder):
    """`SentenceEncoder` over the real tokens of its batch only, in one sequence, attention
    within each text on compress's kernel (`packing.py`): called as it, on a padded batch."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return packed_forward(self, input_ids, attention_mask, token_type_ids)


def pool(tokens: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """One vector per row of `tokens` (rows x length x width) over the kept positions of a
    right-padded batch, by one pooling mode."""
    keep = mask.unsqueeze(-1).to(tokens.dtype)
    if mode == "cls":
        return tokens[:, 0]
    if mode == "max":
        return tokens.masked_fill(keep == 0, torch.finfo(tokens.dtype).min).amax(1)
    if mode == "lasttoken":
        last = mask.sum(1).long() - 1  # right-padded rows: the last kept position
        return tokens[torch.arange(tokens.shape[0]), last]
    if mode == "weightedmean":
        positions = torch.arange(1, tokens.shape[1] + 1, dtype=tokens.dtype,
                                 device=tokens.device).view(1, -1, 1)
        weights = keep * positions
        return (tokens * weights).sum(1) / weights.sum(1).clamp_min(1e-9)
    total = (tokens * keep).sum(1)
    count = keep.sum(1).clamp_min(1e-9)
    return total / (count.sqrt() if mode == "mean_sqrt_len" else count)


def build_encoder(transformer: nn.Module, layout: EncoderLayout) -> SentenceEncoder:
    """The encoder of `layout` around a loaded transformer, in eval mode."""
    return SentenceEncoder(
        transformer, layout.pooling, layout.normalize, layout.max_seq_length,
        layout.matryoshka, [load_dense(layer) for layer in layout.dense], layout.prompts,
        layout.default_prompt_name, layout.truncate_dim, layout.matryoshka_dims).eval()


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
    return build_encoder(transformer, layout), tokenizer, layout

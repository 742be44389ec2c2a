"""The model passed between stages (`ModelBundle`: the model, tokenizer, labels, input
shape) and the figures read off any model's tensors: parameters, sparsity, bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class ModelBundle:
    """The current model with what it needs to run: tokenizer, labels, input shape."""

    model: nn.Module
    kind: str  # "hf", "factory", "pt2e", "runtime", "causal-lm", "embedding" or "reranker"
    label_names: list[str]
    tokenizer: Any = None
    factory: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    input_shape: list[int] = field(default_factory=list)
    structure: dict[str, Any] | None = None  # shapes after structured pruning (to rebuild)
    # a causal LM's facts, as its folder's causal_lm.json holds them: weight scheme, dtype,
    # compile mode, provenance
    causal_lm_facts: dict[str, Any] | None = None

    @property
    def is_text(self) -> bool:
        return self.tokenizer is not None


def count_params(model: nn.Module) -> int:
    """Number of parameters, with the packed weights that modules keep as `qweight` buffers
    (the grouped schemes': int8 codes one a byte, 4-bit codes two a byte)."""
    packed = sum(b.numel() * (2 if b.dtype == torch.uint8 else 1)
                 for name, b in model.named_buffers() if name.endswith("qweight"))
    return sum(p.numel() for p in model.parameters()) + packed


def sparsity(model: nn.Module) -> float:
    """Share of exact zeros over the weight matrices and kernels (tensors with 2+ dims)."""
    zeros = total = 0
    for p in model.parameters():
        if p.dim() >= 2:  # count_nonzero: no boolean copy of the tensor (10x faster)
            zeros += p.numel() - int(torch.count_nonzero(p))
            total += p.numel()
    return zeros / total if total else 0.0


def state_bytes(model: nn.Module) -> int:
    """Bytes of the model's tensors (its size as a weights file, give or take the header)."""
    sizes = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    return sum(sizes.values())

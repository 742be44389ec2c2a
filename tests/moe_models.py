"""Tiny mixture-of-experts causal LMs of each style transformers 5 ships (Mixtral, Qwen2-MoE
with its shared expert and shared_expert_gate, Qwen3-MoE, OLMoE): hidden 64, 2 layers,
4 experts, top-2, random weights (std 0.1, so greedy tokens vary) with every Linear's,
embedding's and expert's weight on `int8_grouped`'s grid (the routers' stay as drawn),
MiniLM's tokenizer; saved as local HF folders."""

from __future__ import annotations

from pathlib import Path

STYLES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def moe_config(style: str, vocab_size: int):  # noqa: ANN201
    """The tiny config of one style."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = {"vocab_size": vocab_size, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "tie_word_embeddings": False,
              "initializer_range": 0.1, "num_experts_per_tok": 2}
    if style == "mixtral":
        return MixtralConfig(**common, intermediate_size=64, num_local_experts=4)
    if style == "qwen2_moe":
        return Qwen2MoeConfig(**common, intermediate_size=64, moe_intermediate_size=64,
                              shared_expert_intermediate_size=64, num_experts=4,
                              decoder_sparse_step=1, norm_topk_prob=False)
    if style == "qwen3_moe":
        return Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=64,
                              num_experts=4, decoder_sparse_step=1, norm_topk_prob=True,
                              head_dim=16)
    return OlmoeConfig(**common, intermediate_size=64, num_experts=4)


def on_int8_grid(weight):  # noqa: ANN001, ANN201
    """A 3D expert weight moved onto a symmetric int8 grid per group of 32 inputs (amax/127
    in float16, as a GGUF's Q8_0 stores it), which `int8_grouped` reproduces exactly."""
    import torch

    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    scale = (groups.abs().amax(-1, keepdim=True) / 127).half().float().clamp_min(2 ** -14)
    return (torch.round(groups / scale).clamp(-127, 127) * scale).reshape(weight.shape)


def tiny_moe(style: str):  # noqa: ANN201
    """(model, tokenizer) of one style, in eval mode, its weights on the int8 grid (but the
    routers': `int8_grouped` keeps them float)."""
    import torch
    from conftest import minilm_folder
    from torch import nn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serve.causal_lm.runtime.experts import is_experts

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config(style, tokenizer.vocab_size))
    with torch.no_grad():
        for module in model.modules():
            if is_experts(module):
                module.gate_up_proj.copy_(on_int8_grid(module.gate_up_proj))
                module.down_proj.copy_(on_int8_grid(module.down_proj))
            elif isinstance(module, nn.Linear | nn.Embedding):
                module.weight.copy_(on_int8_grid(module.weight))
    return model.eval(), tokenizer


def tiny_moe_folder(style: str, folder: Path) -> Path:
    """`tiny_moe(style)` saved into `folder`; return it."""
    model, tokenizer = tiny_moe(style)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder

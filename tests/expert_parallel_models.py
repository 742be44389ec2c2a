"""The tiny mixture-of-experts causal LM the expert-parallel tests share: Mixtral-style,
hidden 64, 2 layers, 4 experts, top-2, random weights (std 0.1, so its greedy tokens vary),
with MiniLM's tokenizer, saved as a local HF folder."""

from __future__ import annotations

from pathlib import Path


def tiny_mixtral_folder(folder: Path) -> Path:
    """Write the model and its tokenizer into `folder`; return it."""
    import torch
    from conftest import minilm_folder
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(minilm_folder())
    config = MixtralConfig(vocab_size=tokenizer.vocab_size, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=256, tie_word_embeddings=False,
                           initializer_range=0.1)
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder

"""Activation-aware scaling before int4 (compress.families.causal_lm.algorithms.equalize) on a
tiny random Llama."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from compress.families.causal_lm.algorithms import equalize


def _llama_with_an_outlier_channel() -> LlamaForCausalLM:
    """A 2-layer Llama whose MLP input carries one channel 30x larger than the rest (as
    trained LMs do), so plain int4 groups around it waste their grid."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight[5] = 30.0
            layer.mlp.up_proj.weight[7] *= 20.0
    return model


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 96, (2, 24), generator=generator) for _ in range(3)]


def test_folding_keeps_the_float_function_and_lowers_the_int4_error() -> None:
    model = _llama_with_an_outlier_channel()
    original = copy.deepcopy(model)
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(2))
    figures = equalize.equalize(model, _batches(), "int4_weight_only", 32)
    assert figures["equalize_pairs_seen"] == 6  # attn, mlp and down in each of 2 layers
    assert figures["equalized_pairs"] >= 2
    assert figures["equalize_error_ratio"] < 0.8, figures
    with torch.inference_mode():
        before, after = original(input_ids=ids).logits, model(input_ids=ids).logits
    assert torch.allclose(before, after, atol=1e-4), (before - after).abs().max()
    # the scaled MLP input columns moved: the outlier's norm weight was divided
    assert model.model.layers[0].post_attention_layernorm.weight[5] < 30.0


def test_scales_never_make_a_pair_worse_than_plain_rounding() -> None:
    torch.manual_seed(3)
    linear = torch.nn.Linear(64, 48, bias=False)
    inputs = torch.randn(256, 64)
    inputs[:, 9] *= 40.0
    scales, alpha, error, plain = equalize.best_scales(inputs, [linear],
                                                       "int4_weight_only", 32)
    assert alpha > 0 and error < 0.7 * plain, (alpha, error, plain)
    assert scales.shape == (64,) and scales[9] == scales.max()
    flat = torch.randn(256, 64)
    _, alpha, error, plain = equalize.best_scales(flat, [linear], "int4_weight_only", 32)
    assert error <= plain

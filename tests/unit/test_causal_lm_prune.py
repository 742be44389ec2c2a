"""Structured pruning of a causal LM on a tiny random Llama: whole feed-forward neurons and
whole key-value groups go, the same number in every layer, and the kept units compute what
they did (the pipeline run: tests/integration/test_causal_lm_stages.py)."""

from __future__ import annotations

import torch

from compress.families.causal_lm.algorithms.pruning import prune_causal_lm, prune_kv_groups


def _llama(heads: int = 4, kv_heads: int = 2, width: int = 64, hidden: int = 32
           ) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=width,
                         num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def test_a_key_value_group_goes_with_its_query_heads_and_the_rest_is_untouched() -> None:
    model = _llama(heads=6, kv_heads=3, hidden=48)  # head_dim 8
    attn = model.model.layers[0].self_attn
    with torch.no_grad():  # make group 1 the least important in every layer
        for layer in model.model.layers:
            a = layer.self_attn
            a.k_proj.weight[8:16] *= 0.01
            a.v_proj.weight[8:16] *= 0.01
            a.q_proj.weight[16:32] *= 0.01
            a.o_proj.weight[:, 16:32] = 0  # group 1 adds nothing to the output
    k_before, q_before = attn.k_proj.weight.clone(), attn.q_proj.weight.clone()
    v_before, o_before = attn.v_proj.weight.clone(), attn.o_proj.weight.clone()
    ids = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        logits_before = model(input_ids=ids).logits
    assert prune_kv_groups(model, 1) == (4, 2)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.shape == (16, 48) and attn.q_proj.weight.shape == (32, 48)
    assert attn.o_proj.weight.shape == (48, 32)
    assert torch.equal(attn.k_proj.weight, torch.cat([k_before[:8], k_before[16:]]))
    assert torch.equal(attn.q_proj.weight, torch.cat([q_before[:16], q_before[32:]]))
    assert torch.equal(attn.v_proj.weight, torch.cat([v_before[:8], v_before[16:]]))
    assert torch.equal(attn.o_proj.weight, torch.cat([o_before[:, :16], o_before[:, 32:]], 1))
    assert model.config.head_dim == 8 and model.config.num_key_value_heads == 2
    with torch.no_grad():  # the kept heads compute what they did, so the output is the same
        logits_after = model(input_ids=ids).logits
    assert logits_after.shape == (2, 10, 64)
    torch.testing.assert_close(logits_after, logits_before, atol=1e-5, rtol=1e-5)


def test_prune_causal_lm_removes_the_share_asked_for_in_every_layer() -> None:
    model = _llama()
    before = sum(p.numel() for p in model.parameters())
    assert prune_causal_lm(model, "ffn+heads", 0.5) == {"attention_heads": 2, "key_value_heads": 1,
                                                        "intermediate_size": 32}
    for layer in model.model.layers:
        assert layer.mlp.down_proj.weight.shape == (32, 32)
        assert layer.self_attn.v_proj.weight.shape == (8, 32)
    assert sum(p.numel() for p in model.parameters()) < before

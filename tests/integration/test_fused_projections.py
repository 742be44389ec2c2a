"""A layer's kernel projections of one input fused into one kernel call
(serve/causal_lm/runtime/fused.py), grouped and 2:4 alike: the logits are the unfused model's bit
for bit, eager and compiled, with 4 products a layer instead of 7; the state dict is unchanged;
loading weights into a fused model is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from serve.causal_lm.runtime import fused
from serve.causal_lm.runtime.decode import StaticDecoder
from serve.causal_lm.runtime.kernels import build_error, grouped_mm_available
from serve.causal_lm.runtime.loading import quantize_weights

pytestmark = pytest.mark.skipif(not grouped_mm_available(), reason=f"{build_error()}")


def llama(sparse24: bool = False) -> LlamaForCausalLM:
    """A tiny random Llama; `sparse24`: its layers' Linears pruned 2:4 (the 2 largest of 4)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, initializer_range=0.1)).eval()
    for linear in (m for m in model.model.layers.modules() if sparse24 and
                   isinstance(m, torch.nn.Linear)):
        quads = linear.weight.data.view(linear.out_features, -1, 4)
        quads.scatter_(-1, quads.abs().topk(2, dim=-1, largest=False).indices, 0.0)
    return model


def products(model: torch.nn.Module, run) -> int:  # noqa: ANN001
    """Kernel calls (grouped and 2:4) while `run` runs."""
    with torch.profiler.profile() as prof:
        run()
    return sum(e.count for e in prof.key_averages()
               if e.key.startswith(("compress_lm::grouped_mm", "compress_lm::sparse24_mm")))


@pytest.mark.parametrize("scheme", ["int8_grouped", "int4_grouped", "int8_sparse24",
                                    "int4_sparse24"])
def test_fused_projections_give_the_unfused_logits_bit_for_bit(scheme) -> None:
    model = quantize_weights(llama("sparse24" in scheme), scheme)  # fitted: fused
    assert all(hasattr(layer.self_attn, "fused_projections")
               and hasattr(layer.mlp, "fused_projections") for layer in model.model.layers)
    plain = copy.deepcopy(model)
    for layer in plain.model.layers:  # the same weights, each projection its own product
        for block, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                             (layer.mlp, ("gate_proj", "up_proj"))):
            block._forward_pre_hooks.clear()
            del block.fused_projections
            for name in names:
                getattr(block, name).fused = False
                getattr(block, name).pack()
    assert plain.state_dict().keys() == model.state_dict().keys()
    ids = torch.tensor([[5, 17, 3, 9, 5, 17, 40, 2]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, plain(ids).logits)
        # per layer: 4 products fused (qkv, o, gate-up, down), 7 apart; and the (grouped) head
        assert products(model, lambda: model(ids)) == 2 * 4 + 1
        assert products(plain, lambda: plain(ids)) == 2 * 7 + 1
    prompts = [[5, 17, 3, 9], [8, 2, 44, 61, 7]]
    want = StaticDecoder(plain, 64).compile().generate(prompts, 10).rows
    assert StaticDecoder(model, 64).compile().generate(prompts, 10).rows == want


def test_a_fused_model_refuses_new_weights_and_fuses_once() -> None:
    model = quantize_weights(llama(), "int8_grouped")
    with pytest.raises(RuntimeError, match="load a state dict before fuse_projections"):
        model.load_state_dict(model.state_dict())
    assert fused.fuse_projections(model) == 0  # already fused: nothing more
    fresh = quantize_weights(llama(), "int8_grouped", fit=False)  # as load_folder builds it
    assert not hasattr(fresh.model.layers[0].self_attn, "fused_projections")
    fresh.load_state_dict(model.state_dict())
    assert fused.fuse_projections(fresh) == 2 * 2  # attention and MLP of both layers

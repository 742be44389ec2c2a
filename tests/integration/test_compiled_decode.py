"""The static-cache decoders compiled by Inductor (moved out of the unit tier, where a
compile costs 30-120 s): eager and compiled tokens equal `generate`'s, two same-shaped models
keep their own graphs, one graph reads a growing window, and a Llama on GGUF grids decodes
its float tokens through the grouped kernel, compiled; rows joining a continuous batch of
compiled decoders get their own tokens."""

from __future__ import annotations

import pytest
import torch
from batcher_checks import rows_joining_at_any_step_decode_their_tokens_alone, varied_model
from builders import q4_1, q8_0
from torch import nn

from compress.families.causal_lm.model import StaticDecoder
from serve.causal_lm.runtime import grouped
from serve.causal_lm.runtime.kernels import build_error
from serve.causal_lm.runtime.loading import StaticDecoder as RuntimeDecoder
from serve.causal_lm.runtime.loading import quantize_weights


def test_static_decoder_matches_generate_eager_and_compiled(tiny_llama) -> None:
    model, tokenizer = tiny_llama
    prompt = tokenizer("the film was", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        want = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=0)[0, prompt.shape[1]:].tolist()
    eager = StaticDecoder(model, max_cache_len=64).generate(prompt, 12)
    assert eager.tokens == want and eager.ttft_s > 0 and eager.decode_tokens_per_s > 0
    compiled = StaticDecoder(model, max_cache_len=64).compile().generate(prompt, 12)
    assert compiled.tokens == want
    with pytest.raises(ValueError, match="exceeds the cache of 64"):
        StaticDecoder(model, max_cache_len=64).generate(prompt, 64)


def test_two_same_shaped_models_compiled_in_one_process_decode_their_own_tokens() -> None:
    """Freezing folds weights into the compiled decode graph: a second model of the same
    shapes must get its own graph, not the first one's weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
        for p in model.parameters():
            p.data.normal_(0, 0.2)  # varied greedy tokens
        models.append(model)
    ids = torch.tensor([[5, 17, 42, 7]])
    eager = [StaticDecoder(m, 32).generate(ids, 10).tokens for m in models]
    assert eager[0] != eager[1]
    compiled = [StaticDecoder(m, 32).compile().generate(ids, 10).tokens for m in models]
    assert compiled == eager


def test_compiled_decode_reads_a_growing_window_with_one_graph(tiny_llama) -> None:
    """The compiled step attends over the positions written so far (a dynamic size): one
    graph for every step, tokens equal to the model's own attention, padded rows too; the
    model's attention setting is given back after each generate."""
    from torch._dynamo.utils import counters

    model, tokenizer = tiny_llama
    prompts = [tokenizer("the film was")["input_ids"], tokenizer("a")["input_ids"]]
    own = StaticDecoder(model, max_cache_len=64)
    own.attention = None  # the model's SDPA in every step
    want = own.generate(prompts, 10).rows
    decoder = StaticDecoder(model, max_cache_len=64, always_mask=True).compile()
    counters.clear()
    assert decoder.generate(prompts, 10).rows == want
    assert decoder.generate([prompts[0], prompts[0]], 20).rows[0] == own.generate(
        [prompts[0]], 20).tokens
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("scheme", ["int8_grouped", "int4_grouped"])
def test_a_llama_on_gguf_grids_decodes_the_float_tokens_compiled(varied_llama_folder,
                                                                 scheme) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(varied_llama_folder).eval()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.weight.data = (q8_0 if name == "lm_head" else q4_1)(module.weight.data)
    table = model.get_input_embeddings().weight
    table.data = q8_0(table.data)
    packed = AutoModelForCausalLM.from_pretrained(varied_llama_folder).eval()
    packed.load_state_dict(model.state_dict())
    quantize_weights(packed, scheme, 32)
    linears = [m for m in packed.modules() if isinstance(m, grouped.GroupedLinear)]
    assert [m.bits for m in linears].count(grouped.BITS[scheme]) >= 14
    assert all(m.half_scales for m in linears)  # GGUF grids: float16 scales in the kernel's records
    assert len(linears) == 16  # 14 in the layers, the head, the embedding's table
    # the kernel's layouts: the forward runs the kernel, not the torch fallback (a fused
    # projection's records are its block's group's: serve/causal_lm/runtime/fused.py)
    assert sum(m.packed is not None or m.fused for m in linears) >= 15, build_error()
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    assert isinstance(packed.get_input_embeddings(), grouped.GroupedEmbedding)
    ids = torch.tensor([[101, 2023, 3185, 2001, 2204, 102, 7592, 2088]])
    with torch.inference_mode():
        want, got = model(input_ids=ids).logits, packed(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    prompts = [[101, 2023, 3185, 2001], [101, 7592, 2088, 999, 2054]]
    reference = RuntimeDecoder(model, 64).generate(prompts, 12).rows
    # the C++ wrapper, and guards checked on each generation's first step only
    decoder = RuntimeDecoder(packed, 64).compile(cpp_wrapper=scheme == "int4_grouped",
                                                 skip_guards=True)
    assert decoder.inductor["freezing"] is False  # freezing would fold the int8 to float
    assert decoder.generate(prompts, 12).rows == reference
    assert packed.lm_head.qweight.dtype == torch.int8  # the head stays 8-bit (Q8_0)
    # batched: eight rows of different lengths, left padded, give each row's own tokens;
    # two decoders in turn, guards skipped after each first step, keep to their own graphs
    eight = [[101, 2023 + i, 3185, 2001][: 2 + i % 3] for i in range(8)]
    alone = [RuntimeDecoder(model, 64).generate([p], 6).rows[0] for p in eight]
    assert RuntimeDecoder(packed, 64).compile(skip_guards=True).generate(eight, 6).rows == alone
    assert decoder.generate(prompts, 12).rows == reference


def test_rows_joining_a_compiled_batch_decode_their_tokens_alone(monkeypatch) -> None:
    rows_joining_at_any_step_decode_their_tokens_alone(varied_model(), monkeypatch, "default")

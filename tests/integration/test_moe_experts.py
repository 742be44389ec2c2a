"""Mixture-of-experts causal LMs of each style transformers 5 ships, tiny and random
(`moe_models.py`): the grouped experts compute the dequantized float experts' output
through the kernel (int8 and int4, 1 and several tokens) and read only the routed experts'
records; `int8_grouped` decodes the float model's greedy tokens, eager and compiled, and
survives a save and load; `keep_experts` keeps a share; other schemes refuse MoE models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from moe_models import STYLES, tiny_moe

from serve.causal_lm.runtime import loading
from serve.causal_lm.runtime.experts import (
    GroupedExperts,
    expert_count,
    is_experts,
    keep_experts,
    routed_experts,
)
from serve.causal_lm.runtime.kernels import build_error, grouped_mm_available

PROMPTS = ["the film was", "a much longer prompt about a movie that goes on and on", "hi"]


def float_experts(module: GroupedExperts):  # noqa: ANN201
    """The experts' output from their dequantized float weights (no kernel)."""
    def run(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return routed_experts(
            x, index, weights, module.num_experts, module.act,
            lambda e, h: torch.nn.functional.linear(h, module.dequantize("gate_up", e)),
            lambda e, h: torch.nn.functional.linear(h, module.dequantize("down", e)))
    return run


@pytest.fixture(scope="module")
def mixtral_experts() -> torch.nn.Module:
    model, _ = tiny_moe("mixtral")
    return model.model.layers[0].mlp.experts


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_grouped_experts_compute_the_dequantized_experts(mixtral_experts, bits, tokens) -> None:
    assert grouped_mm_available(), build_error()
    module = GroupedExperts.from_experts(mixtral_experts, bits)
    assert module.gate_up_packed is not None  # the forward goes through the kernel
    torch.manual_seed(tokens)
    x = torch.randn(tokens, 64)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2)
    want = float_experts(module)(x, index, weights)
    got = module(x, index, weights)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    if bits == 8:  # the weights lie on the int8 grid: the float experts' own output too
        float_out = mixtral_experts(x, index, weights)
        assert (got - float_out).abs().max() <= 1e-5 * float_out.abs().max()


def test_only_the_routed_experts_records_are_read(mixtral_experts) -> None:
    module = GroupedExperts.from_experts(mixtral_experts, 8)
    x, index, weights = torch.randn(3, 64), torch.tensor([[0, 2]] * 3), torch.rand(3, 2)
    want = module(x, index, weights)
    for name in ("gate_up_packed", "down_packed"):  # experts 1 and 3: garbage records
        packed = getattr(module, name)
        packed[[1, 3]] = torch.randint(0, 256, packed[[1, 3]].shape, dtype=torch.uint8)
    assert torch.equal(module(x, index, weights), want)
    packed = module.down_packed
    packed[2] = torch.randint(0, 256, packed[2].shape, dtype=torch.uint8)
    assert not torch.equal(module(x, index, weights), want)  # a routed one is read


def test_keep_experts_keeps_a_share_of_both_kinds(mixtral_experts) -> None:
    import copy

    grouped = GroupedExperts.from_experts(mixtral_experts, 8)
    floats = copy.deepcopy(mixtral_experts)
    assert is_experts(floats) and is_experts(grouped)
    assert expert_count(floats) == expert_count(grouped) == 4
    x, weights = torch.randn(2, 64), torch.rand(2, 2)
    want = grouped(x, torch.tensor([[3, 1]] * 2), weights)
    before = sum(b.numel() * b.element_size() for b in grouped.buffers())
    keep_experts(floats, [3, 1])
    keep_experts(grouped, [3, 1])
    assert expert_count(floats) == expert_count(grouped) == 2
    assert floats.gate_up_proj.shape[0] == 2
    after = sum(b.numel() * b.element_size() for b in grouped.buffers())
    assert after == before // 2
    renumbered = torch.tensor([[0, 1]] * 2)
    assert torch.equal(grouped(x, renumbered, weights), want)
    assert torch.allclose(floats(x, renumbered, weights), want, atol=1e-5)


@pytest.mark.parametrize("style", STYLES)
def test_int8_grouped_decodes_the_float_tokens_eager_compiled_and_reloaded(
        style, tmp_path: Path) -> None:
    from compress.families.causal_lm.folder import save_causal_lm
    from compress.models.bundle import ModelBundle

    model, tokenizer = tiny_moe(style)
    ids = [loading.prompt_ids(tokenizer, p, chat_template=False) for p in PROMPTS]
    want = loading.StaticDecoder(model, 64).generate(ids, 12).rows
    assert len({t for row in want for t in row}) > 12  # tokens vary: no trivial match
    loading.quantize_weights(model, "int8_grouped")
    grouped = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert len(grouped) == 2 and not any(
        is_experts(m) and not isinstance(m, GroupedExperts) for m in model.modules())
    assert loading.StaticDecoder(model, 64).generate(ids, 12).rows == want
    if style == "qwen2_moe":  # one style compiled (fullgraph): the experts are one op
        compiled = loading.StaticDecoder(model, 64).compile()
        assert compiled.generate(ids, 12).rows == want
    bundle = ModelBundle(model, "causal-lm", [], tokenizer=tokenizer,
                         causal_lm_facts={"scheme": "int8_grouped", "group_size": 32})
    save_causal_lm(bundle, tmp_path)
    (tmp_path / loading.CAUSAL_LM_FILE).write_text(json.dumps(bundle.causal_lm_facts))
    loaded = loading.load_folder(tmp_path)
    assert loading.StaticDecoder(loaded.model, 64).generate(ids, 12).rows == want


def test_int4_grouped_experts_hold_half_the_codes_and_reload(tmp_path: Path) -> None:
    from compress.families.causal_lm.folder import save_causal_lm
    from compress.models.bundle import ModelBundle

    model, tokenizer = tiny_moe("qwen3_moe")
    ids = [loading.prompt_ids(tokenizer, p, chat_template=False) for p in PROMPTS]
    loading.quantize_weights(model, "int4_grouped")
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert [m.bits for m in experts] == [4, 4]
    assert experts[0].gate_up_qweight.shape == (4, 128, 32)  # two 4-bit codes a byte
    want = loading.StaticDecoder(model, 64).generate(ids, 12).rows
    bundle = ModelBundle(model, "causal-lm", [], tokenizer=tokenizer,
                         causal_lm_facts={"scheme": "int4_grouped", "group_size": 32,
                                          "head_scheme": "int8_grouped"})
    save_causal_lm(bundle, tmp_path)
    (tmp_path / loading.CAUSAL_LM_FILE).write_text(json.dumps(bundle.causal_lm_facts))
    loaded = loading.load_folder(tmp_path)
    assert loading.StaticDecoder(loaded.model, 64).generate(ids, 12).rows == want


@pytest.mark.parametrize("scheme", ["int8_weight_only", "int8_sparse24"])
def test_other_schemes_refuse_a_moe_model_in_one_line(scheme) -> None:
    model, _ = tiny_moe("olmoe")
    with pytest.raises(ValueError, match=r"int8_grouped or int4_grouped") as refused:
        loading.quantize_weights(model, scheme)
    assert "\n" not in str(refused.value) and scheme in str(refused.value)


@pytest.mark.parametrize("scheme", [None, "int8_grouped"])
def test_bytes_per_token_count_the_routed_experts_share(scheme) -> None:
    from benchmarks.causal_lm import child

    model, _ = tiny_moe("mixtral")
    if scheme:
        loading.quantize_weights(model, scheme)
    experts = [m for m in model.modules() if is_experts(m)]
    whole = sum(child.tensor_bytes(t) for m in experts for t in (
        [m.gate_up_packed, m.down_packed] if scheme else [m.gate_up_proj, m.down_proj]))
    routed = child.weight_bytes_per_token(model)  # top-2 of 4 experts: half of them read
    model.config.num_experts_per_tok = 4
    assert child.weight_bytes_per_token(model) - routed == whole // 2


def test_the_opt_in_activation_modes_reach_the_experts() -> None:
    model, tokenizer = tiny_moe("mixtral")
    ids = loading.prompt_ids(tokenizer, PROMPTS[1], chat_template=False)
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits
        loading.quantize_weights(model, "int8_grouped", activations="int8")
        got = model(torch.tensor([ids])).logits
    assert {m.activations for m in model.modules() if isinstance(m, GroupedExperts)} == {"int8"}
    assert not torch.equal(got, want)  # rounded activations: close, not exact
    assert (got - want).abs().max() < 0.1 * want.abs().max()

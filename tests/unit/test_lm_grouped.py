"""The grouped weight schemes (serve/lm_grouped.py, int8_grouped and int4_grouped) and their
kernel (serve/lm_grouped_kernels.cpp) on random weights and a tiny random Llama whose
weights sit on a GGUF's grids (Q4_1 body, Q8_0 head), as SmolLM2's do."""

from __future__ import annotations

import json

import pytest
import torch
from builders import lm_recipe
from conftest import cli
from torch import nn

from compress.algorithms import lm_qat
from compress.pipeline.loop import run_recipe
from compress.recipe.schema import load_recipe
from serve import lm_grouped as grouped
from serve.lm_grouped_kernels import build_error, grouped_mm_available
from serve.lm_runtime import StaticDecoder, quantize_weights


def q4_1(weight: torch.Tensor) -> torch.Tensor:
    """The weight as llama.cpp's Q4_1 stores it: per 32 inputs, 16 levels from a float16
    minimum in float16 steps."""
    groups = weight.reshape(weight.shape[0], -1, 32)
    low = groups.amin(-1, keepdim=True).half().float()
    step = ((groups.amax(-1, keepdim=True) - low) / 15).half().float()
    levels = torch.round((groups - low) / step).clamp(0, 15)
    return (levels * step + low).reshape(weight.shape)


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    """Q8_0: per 32 inputs, int8 levels of a float16 step amax / 127."""
    groups = weight.reshape(weight.shape[0], -1, 32)
    step = (groups.abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.round(groups / step).clamp(-127, 127) * step).reshape(weight.shape)


def test_weights_on_a_gguf_grid_are_kept_and_others_rounded_within_half_a_step() -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05
    for grid in (q4_1, q8_0):
        on_grid = grid(weight)
        q, scale, offset = grouped.fit_groups(on_grid, 32)
        back = q.view(96, 4, 32).float() * scale[..., None] + offset[..., None]
        assert (back.view(96, 128) - on_grid).abs().max() < 1e-6 * on_grid.abs().max()
        assert torch.allclose(grouped.dequantize_groups(q, scale, offset), back.view(96, 128))
    q, scale, offset = grouped.fit_groups(weight, 32)
    assert q.dtype == torch.int8 and scale.shape == offset.shape == (96, 4)
    back = (q.view(96, 4, 32).float() * scale[..., None] + offset[..., None]).view(96, 128)
    steps = scale.repeat_interleave(32, dim=1)
    assert ((back - weight).abs() <= 0.5001 * steps).all()
    assert (back - weight).abs().max() > 0  # random weights are rounded
    assert torch.equal(lm_qat.fake_quantize(weight, "int8_grouped", 32), back)


def test_the_kernel_is_built_here() -> None:
    assert grouped_mm_available(), build_error()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 13, 40])
def test_the_kernel_computes_the_dequantized_product(rows, bits) -> None:
    """Every row count the kernel treats apart (1-2 rows four weight rows at a time, up to 8
    two at a time, more in chunks of 8 over blocks), odd output counts included."""
    torch.manual_seed(rows)
    linear = nn.Linear(96, 77)
    module = grouped.GroupedLinear.from_linear(linear, 32, bits)
    x = torch.randn(rows, 1, 96)
    want = nn.functional.linear(x, module.dequantize(), linear.bias.detach())
    got = module(x)
    assert got.shape == (rows, 1, 77)
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    # the fallback without the kernel (another group size takes it) agrees
    fallback = grouped.GroupedLinear.from_linear(linear, 16, bits) if bits == 8 else None
    if fallback is not None:
        assert torch.allclose(fallback(x), nn.functional.linear(
            x, fallback.dequantize(), linear.bias.detach()), atol=1e-5)


def test_4_bit_codes_pack_two_a_byte_in_the_gguf_layout() -> None:
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = grouped.pack_nibbles(codes)
    assert packed.shape == (3, 32) and packed.dtype == torch.uint8
    assert torch.equal(packed[:, 0] & 15, codes[:, 0]) and torch.equal(packed[:, 0] >> 4,
                                                                       codes[:, 16])
    assert torch.equal(packed[:, 16] & 15, codes[:, 32])
    assert torch.equal(grouped.unpack_nibbles(packed), codes)


def test_q4_1_weights_are_kept_by_4_bit_groups_to_float32_rounding() -> None:
    torch.manual_seed(2)
    weight = q4_1(torch.randn(64, 128) * 0.05)
    module = grouped.GroupedLinear.from_weight(weight, None, 32, bits=4)
    assert module.qweight.shape == (64, 64) and module.qweight.dtype == torch.uint8
    assert (module.dequantize() - weight).abs().max() < 1e-6 * weight.abs().max()
    rough = torch.randn(64, 128)  # off the grid: within half a step of 15 per group, give or
    module = grouped.GroupedLinear.from_weight(rough, None, 32, bits=4)  # take float16's
    steps = module.scale.repeat_interleave(32, dim=1)  # rounding of the step and minimum
    assert ((module.dequantize() - rough).abs() <= 0.52 * steps).all()
    assert torch.equal(module.scale.half().float(), module.scale)
    assert torch.equal(module.offset.half().float(), module.offset)
    assert torch.equal(lm_qat.fake_quantize(rough, "int4_grouped", 32), module.dequantize())


def test_a_group_size_that_does_not_divide_the_inputs_is_one_line() -> None:
    with pytest.raises(ValueError, match="group_size 48 does not divide a Linear's 64 input"):
        grouped.GroupedLinear.from_linear(nn.Linear(64, 8), 48)
    with pytest.raises(ValueError, match="int4_grouped: group_size must be 32"):
        grouped.GroupedLinear.from_linear(nn.Linear(64, 8), 16, bits=4)


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
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    assert isinstance(packed.get_input_embeddings(), grouped.GroupedEmbedding)
    ids = torch.tensor([[101, 2023, 3185, 2001, 2204, 102, 7592, 2088]])
    with torch.inference_mode():
        want, got = model(input_ids=ids).logits, packed(input_ids=ids).logits
    assert (got - want).abs().max() < 1e-5 * want.abs().max()
    prompts = [[101, 2023, 3185, 2001], [101, 7592, 2088, 999, 2054]]
    reference = StaticDecoder(model, 64).generate(prompts, 12).rows
    # the C++ wrapper, and guards checked on each generation's first step only
    decoder = StaticDecoder(packed, 64).compile(cpp_wrapper=scheme == "int4_grouped",
                                                skip_guards=True)
    assert decoder.inductor["freezing"] is False  # freezing would fold the int8 to float
    assert decoder.generate(prompts, 12).rows == reference
    assert packed.lm_head.qweight.dtype == torch.int8  # the head stays 8-bit (Q8_0)
    # batched: eight rows of different lengths, left padded, give each row's own tokens;
    # two decoders in turn, guards skipped after each first step, keep to their own graphs
    eight = [[101, 2023 + i, 3185, 2001][: 2 + i % 3] for i in range(8)]
    alone = [StaticDecoder(model, 64).generate([p], 6).rows[0] for p in eight]
    assert StaticDecoder(packed, 64).compile(skip_guards=True).generate(eight, 6).rows == alone
    assert decoder.generate(prompts, 12).rows == reference


def test_the_stage_saves_a_model_that_reloads_and_refuses_bfloat16(
        tmp_path, varied_llama_folder, monkeypatch, capsys) -> None:
    stages = [{"kind": "quantize", "scheme": "int8_grouped"}]
    recipe = load_recipe(lm_recipe(tmp_path, varied_llama_folder, stages), check_sources=True)
    run_dir = run_recipe(recipe, echo=lambda _: None)
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"][0]
    metrics = stage["metrics"]
    assert metrics["activation_dtype"] == "float32" and metrics["head_scheme"] == "int8_grouped"
    assert abs(metrics["perplexity_delta_vs_float_pct"]) < 0.5
    assert metrics["next_token_agreement_decisive"] == 1.0
    from compress.models.folders import load_saved

    saved = load_saved(run_dir / stage["outputs"][0]["model_dir"])
    assert isinstance(saved.model.lm_head, grouped.GroupedLinear)
    # the untied head and the embedding table each count, beside the layers' weights
    config = saved.model.config
    vocab, hidden = config.vocab_size, config.hidden_size
    assert metrics["params"] > 2 * vocab * hidden

    bad = lm_recipe(tmp_path, varied_llama_folder, [
        {"kind": "quantize", "scheme": "int8_grouped", "activations": "bfloat16"}])
    code, _, err = cli(monkeypatch, capsys, "validate", str(bad))
    assert code == 2 and "stages.0.activations: int8_grouped computes in float32" in err
    assert "Traceback" not in err

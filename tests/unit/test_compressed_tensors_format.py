"""Issue 76 items 1 and 3 in-process: `grid: compressed_tensors` fits the grouped schemes on
the grids a compressed-tensors checkpoint holds, `export.compressed_tensors` writes a tiny
Llama as that format (its packing is the package's own), transformers loads the folder and
its logits are the model's; what the format cannot hold is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from export.compressed_tensors import (
    CompressedTensorsError,
    pack_codes,
    write_compressed_tensors,
)
from serve.causal_lm.runtime.grouped import GroupedLinear, fit_groups
from serve.causal_lm.runtime.loading import quantize_weights


def model_of(folder: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(folder).eval(),
            AutoTokenizer.from_pretrained(folder))


def test_the_4_bit_grid_has_integer_zero_points_and_float16_steps() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 128) * 0.05
    weight[0, :32] = weight[0, :32].abs() + 0.01  # a group all above zero: 0 joins its range
    codes, step, offset = fit_groups(weight, 32, 4, "compressed_tensors")
    zero = -offset / step
    assert torch.equal(zero, zero.round()) and zero.min() >= 0 and zero.max() <= 15
    assert torch.equal(step.half().float(), step)
    assert zero[0, 0] == 0  # the all-positive group starts at 0
    values = (codes.view(64, 4, 32).float() * step[..., None] + offset[..., None]).view(64, 128)
    assert float((values - weight).abs().max()) <= float(step.max()) / 2 + 1e-7
    # the format's own dequantization of the same codes: (q - z) x s, bit for bit
    signed = codes.view(64, 4, 32).float() - 8
    theirs = ((signed - (zero[..., None] - 8)) * step[..., None]).view(64, 128)
    assert torch.equal(theirs, values)
    # 8 bits: llama.cpp's Q8_0 grid, which is the format's symmetric int8
    assert all(torch.equal(a, b) for a, b in zip(fit_groups(weight, 32, 8, "compressed_tensors"),
                                                 fit_groups(weight, 32, 8, "gguf"), strict=True))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_packing_is_the_packages_own(bits: int, dim: int) -> None:
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    torch.manual_seed(bits + dim)
    unsigned = torch.randint(0, 2 ** bits, (24, 40), dtype=torch.int32)  # 40: a partial word
    signed = (unsigned - 2 ** (bits - 1)).to(torch.int8)
    theirs = helpers.pack_to_int32(signed, bits, packed_dim=dim)
    ours = pack_codes(unsigned, bits) if dim == 1 else pack_codes(unsigned.t(), bits).t()
    assert torch.equal(ours, theirs)
    assert torch.equal(helpers.unpack_from_int32(ours.contiguous(), bits, signed.shape, dim),
                       signed)


@pytest.mark.parametrize(("scheme", "grid"), [("int8_grouped", "compressed_tensors"),
                                              ("int4_grouped", "compressed_tensors"),
                                              ("int4_grouped", "free")])
def test_transformers_loads_the_folder_and_its_logits_are_the_models(
        varied_llama_folder: Path, tmp_path: Path, scheme: str, grid: str) -> None:
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, tokenizer = model_of(varied_llama_folder)
    quantize_weights(model, scheme, 32, grid=grid)
    written = write_compressed_tensors(model, tokenizer, tmp_path / "ct", 32)
    config = json.loads((tmp_path / "ct/config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    bits = 8 if scheme == "int8_grouped" else 4
    assert [g["weights"]["num_bits"] for g in groups.values()] == [bits]
    assert groups["group_0"]["weights"]["symmetric"] is (bits == 8)
    # 2 layers x 7 projections, and the (untied) int8 head where the layers are int8 too:
    # under int4 layers it stays float (transformers reads one scheme)
    assert len(groups["group_0"]["targets"]) == 14 + (bits == 8)
    assert config["quantization_config"]["ignore"] == (["lm_head"] if bits == 4 else [])
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ct", dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    ids = tokenizer(["a gentle, funny and moving portrait", "the plot is thin"],
                    return_tensors="pt", padding=True)
    with torch.inference_mode():
        ours, theirs = model(**ids).logits, loaded(**ids).logits
    if grid == "compressed_tensors":  # every weight on the format's grid: the same numbers
        assert written.rerounded == 0 and written.max_rounding == 0.0
        for name, module in model.named_modules():
            if isinstance(module, GroupedLinear) and name.startswith("model.layers"):
                assert torch.equal(module.dequantize(), loaded.get_submodule(name).weight)
        assert float((ours - theirs).abs().max()) <= 1e-4
    else:  # Q4_1's free minimums re-rounded onto integer zero points, the change reported
        assert written.rerounded > 0 and 0 < written.max_rounding < 0.1
        worst = max(float((m.dequantize() - loaded.get_submodule(n).weight).abs().max())
                    for n, m in model.named_modules()
                    if isinstance(m, GroupedLinear) and n.startswith("model.layers"))
        assert worst == pytest.approx(written.max_rounding, rel=1e-5)
        assert float((ours - theirs).abs().max()) > 1e-4  # re-rounding shows


def test_what_the_format_cannot_hold_is_one_line(varied_llama_folder: Path,
                                                 tmp_path: Path) -> None:
    model, tokenizer = model_of(varied_llama_folder)
    with pytest.raises(CompressedTensorsError, match="nothing to compress"):
        write_compressed_tensors(model, tokenizer, tmp_path / "float", 32)
    layer = model.model.layers[0]
    layer.mlp.gate_proj = nn.Linear(32, 32, bias=False)  # pruned in one layer only
    quantize_weights(model, "int8_grouped", 32, grid="compressed_tensors")
    with pytest.raises(CompressedTensorsError, match="^intermediate_size: pruning left "
                       "mlp.gate_proj 2 different widths"):
        write_compressed_tensors(model, tokenizer, tmp_path / "pruned", 32)
    assert not (tmp_path / "pruned").exists() and not list(tmp_path.glob(".pruned*"))


def test_the_recipe_refuses_a_scheme_the_format_cannot_hold(tmp_path: Path, data_dir: Path,
                                                          monkeypatch) -> None:
    from compress.errors import UserError
    from compress.recipe.schema import load_recipe

    monkeypatch.setenv("COMPRESS_DATA_DIR", str(data_dir))
    base = {"name": "ct", "model": {"source": "HuggingFaceTB/SmolLM2-135M-Instruct"},
            "data": {"source": "stanfordnlp/sst2", "text_column": "sentence"}}
    for stages, line in (
            ([{"kind": "quantize", "scheme": "int8_weight_only"},
              {"kind": "export", "format": "compressed_tensors"}],
             "stages.1.format: compressed_tensors holds int8_grouped and int4_grouped weights "
             "(nothing to compress in a float model), not int8_weight_only"),
            ([{"kind": "export", "format": "compressed_tensors"}],
             "stages.0.format: compressed_tensors holds int8_grouped and int4_grouped weights "
             "(nothing to compress in a float model), not float"),
            ([{"kind": "quantize", "scheme": "int8_weight_only", "grid": "compressed_tensors"}],
             "stages.0.grid: compressed_tensors fits the grouped schemes' groups")):
        path = tmp_path / "ct.yaml"
        path.write_text(json.dumps({**base, "stages": stages}))
        with pytest.raises(UserError) as caught:
            load_recipe(path, check_sources=True)
        assert any(line in m for m in caught.value.messages), caught.value.messages

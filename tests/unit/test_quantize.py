"""int8 through torch.export + torchao PT2E: accuracy, modes, save/load, failures, the CLI."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from builders import (
    DataDependent,
    digits_like,
    image_bundle,
    stage_context,
    stage_quantize,
)
from torch import nn

from compress.errors import CaptureError
from compress.measure.evaluate import logits_of
from compress.models.zoo import mlp
from compress.recipe.kinds.quantize import QuantizeConfig


@torch.inference_mode()
@pytest.mark.parametrize("per_channel", [True, False])
def test_dynamic_mode_and_per_tensor_weights(per_channel: bool, trained_mlp: nn.Module,
                                             tmp_path: Path) -> None:
    model = trained_mlp
    cfg = QuantizeConfig(mode="dynamic", per_channel=per_channel, compile=False)
    quantized, metrics = stage_quantize(image_bundle(model), cfg,
                                        stage_context(tmp_path, digits_like()))
    assert metrics["quant_mode"] == "dynamic" and "calibration_samples" not in metrics
    x = torch.rand(100, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    ref, got = model(x), logits_of(quantized.model, x)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    weight_dequant = "per_channel" if per_channel else "per_tensor"
    ops = {str(node.target) for node in quantized.model.graph.graph.nodes}
    assert f"quantized_decomposed.dequantize_{weight_dequant}.default" in ops


def test_keep_float_leaves_matching_modules_unquantized(tmp_path: Path) -> None:
    def weight_dequants(keep: list[str]) -> int:
        cfg = QuantizeConfig(mode="dynamic", keep_float=keep, compile=False)
        quantized, _ = stage_quantize(image_bundle(mlp()), cfg,
                                      stage_context(tmp_path, digits_like()))
        return sum("dequantize_per_channel" in str(node.target)
                   for node in quantized.model.graph.graph.nodes)

    assert weight_dequants([]) == 2
    assert weight_dequants(["3"]) == 1


def test_uncapturable_model_is_a_one_line_capture_error(tmp_path: Path) -> None:
    bundle = image_bundle(DataDependent())
    with pytest.raises(CaptureError) as info:
        stage_quantize(bundle, QuantizeConfig(mode="dynamic"),
                       stage_context(tmp_path, digits_like()))
    assert str(info.value).startswith("torch.export could not capture the model: ")
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_the_deprecated_quantization_api_is_not_used(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cfg = QuantizeConfig(mode="static", compile=False,
                             calibration={"samples": 8, "batch_size": 8})
        stage_quantize(image_bundle(mlp()), cfg, stage_context(tmp_path, digits_like()))
    assert "torch.ao.quantization.quantize_fx" not in sys.modules


@pytest.mark.parametrize(("flags", "saturate"), [
    ({"avx2", "fma"}, True),                         # Zen 3, Haswell: vpmaddubsw's int16
    ({"avx2", "avx512f", "avx512bw"}, True),          # Skylake-SP: AVX-512, still no VNNI
    ({"avx2", "avx512f", "avx512_vnni"}, False),      # Cascade Lake, Zen 4 and 5
    ({"avx2", "avx_vnni"}, False),                    # Alder Lake's AVX-VNNI
    ({"avx2", "amx_int8", "avx512_vnni"}, False),     # Sapphire Rapids
    (set(), False),                                   # flags not readable
    ({"neon", "asimd"}, False),                       # not x86
])
def test_int8_products_saturate_only_on_x86_without_an_int32_dot_product(
        flags: set[str], saturate: bool) -> None:
    from serve import cpu_features

    assert cpu_features.int8_products_saturate(frozenset(flags)) is saturate


@torch.inference_mode()
@pytest.mark.parametrize(("mode", "saturate", "top"), [
    ("static", True, 127), ("static", False, 255),
    ("dynamic", True, 255), ("dynamic", False, 255)])  # a batch's own range: 8 bits always
def test_static_activations_keep_to_7_bits_where_int8_products_saturate(
        mode: str, saturate: bool, top: int, trained_mlp: nn.Module, tmp_path: Path,
        monkeypatch) -> None:
    """On a CPU without VNNI (AVX2's vpmaddubsw adds two u8 x s8 products into a saturating
    int16) static int8 quantizes activations to 0..127, as torchao's reduce_range does, and
    the metrics say so; elsewhere, and for dynamic int8 anywhere, to 0..255."""
    from serve import cpu_features

    monkeypatch.setattr(cpu_features, "int8_products_saturate", lambda *a: saturate)
    cfg = QuantizeConfig(mode=mode, compile=False)
    quantized, metrics = stage_quantize(image_bundle(trained_mlp), cfg,
                                        stage_context(tmp_path, digits_like()))
    assert metrics["int8_reduce_range"] is (top == 127)
    activation_ranges = {(node.args[3], node.args[4])
                         for node in quantized.model.graph.graph.nodes
                         if str(node.target).startswith("quantized_decomposed.quantize_per_tensor")}
    assert activation_ranges == {(0, top)}, activation_ranges
    x = torch.rand(100, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    agreement = (logits_of(quantized.model, x).argmax(-1) == trained_mlp(x).argmax(-1))
    assert agreement.float().mean() >= 0.9


def test_only_static_int8_keeps_activations_to_7_bits(monkeypatch) -> None:
    from compress.algorithms.quantization import reduce_range
    from serve import cpu_features

    monkeypatch.setattr(cpu_features, "int8_products_saturate", lambda *a: True)
    assert [reduce_range(mode) for mode in ("static", "dynamic", "qat")] == [True, False, False]
    monkeypatch.setattr(cpu_features, "int8_products_saturate", lambda *a: False)
    assert not any(reduce_range(mode) for mode in ("static", "dynamic", "qat"))


@pytest.mark.parametrize(("cpu_flags", "rounding"), [
    ({"avx2", "avx512_vnni"}, "int8"), ({"avx2", "avx_vnni"}, "int8"),
    ({"avx512f", "amx_int8"}, "int8"), ({"avx2", "fma"}, None), (set(), None)])
def test_int8_where_vnni_rounds_activations_to_int8_only_on_a_cpu_with_int32_dot_products(
        cpu_flags: set[str], rounding: str | None, monkeypatch) -> None:
    """The shipped LLM recipes' mode: llama.cpp's int8 rounding where the CPU multiplies u8 by
    s8 into int32 in one instruction, exact float32 elsewhere; the explicit modes whatever
    the CPU."""
    from compress.families.causal_lm.stages.quantize import activation_dtype, rounding_of
    from serve import cpu_features

    monkeypatch.setattr(cpu_features, "flags", lambda: frozenset(cpu_flags))
    assert rounding_of("int8_where_vnni") == rounding
    assert [rounding_of(m) for m in ("int8", "bf16", "float32", "auto")] == [
        "int8", "bf16", None, None]
    # the grouped schemes keep float32 tensors in every mode: their kernels round
    assert activation_dtype("int8_where_vnni", "int4_grouped") == "float32"

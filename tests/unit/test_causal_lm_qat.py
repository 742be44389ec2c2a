"""Quantization-aware training of a causal LM (compress.families.causal_lm.algorithms.qat and
`quantize` mode qat)."""

from __future__ import annotations

import json

import torch
from builders import causal_lm_recipe
from torch import nn

from compress.families.causal_lm.algorithms import qat
from compress.models.folders import load_saved
from compress.pipeline.loop import run_recipe
from compress.recipe.schema import load_recipe
from serve.causal_lm.runtime.loading import head_scheme_of, weight_config


def _dequantized(weight: torch.Tensor, scheme: str) -> torch.Tensor:
    """The weight torchao's `quantize_` really computes with (read back through an identity
    input)."""
    from torchao.quantization import quantize_

    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=torch.bfloat16)
    layer.weight.data = weight.to(torch.bfloat16)
    quantize_(layer, weight_config(scheme, 32))
    with torch.inference_mode():
        return layer(torch.eye(weight.shape[1], dtype=torch.bfloat16)).T.float()


def test_the_fake_grid_is_the_grid_torchao_quantizes_onto() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 128) * 0.05
    for scheme, ratio in (("int4_weight_only", 0.1), ("int8_weight_only", 0.6)):
        snapped = qat.fake_quantize(weight, scheme, 32)
        raw_error = (_dequantized(weight, scheme) - weight).norm() / weight.norm()
        snapped_error = (_dequantized(snapped, scheme) - snapped).norm() / snapped.norm()
        # a weight already on the grid goes through the real kernels unchanged up to the
        # bf16 rounding of scales and of the read-back output (about 0.3%); an arbitrary
        # one loses 0.7% (int8) to 8% (int4)
        assert raw_error > 0.006, (scheme, raw_error)
        assert snapped_error < ratio * raw_error, (scheme, snapped_error, raw_error)


def test_prepare_fake_quantizes_each_linear_with_a_straight_through_gradient() -> None:
    layer = nn.Sequential(nn.Linear(64, 32, bias=False))
    model = nn.Module()
    model.body = layer
    model.lm_head = nn.Linear(64, 40, bias=False)
    model.get_input_embeddings = lambda: nn.Embedding(40, 64)
    assert qat.prepare(model, "int4_weight_only", 32, "float") == 1
    original = layer[0].parametrizations.weight.original
    assert torch.equal(layer[0].weight, qat.fake_quantize(original, "int4_weight_only", 32))
    layer[0](torch.ones(2, 64)).sum().backward()
    assert torch.equal(original.grad, torch.ones(32, 2) @ torch.ones(2, 64))
    qat.snap(model)
    assert isinstance(layer[0].weight, nn.Parameter) and not hasattr(layer[0], "parametrizations")
    assert head_scheme_of("int4_weight_only") == "int8_weight_only"
    assert head_scheme_of("int8_weight_only", "auto") == "int8_weight_only"
    assert head_scheme_of("int4_weight_only", "float") == "float"


def test_a_causal_lm_quantize_stage_trains_on_the_grid_then_quantizes(
        tmp_path, tiny_llama_folder) -> None:
    stages = [{"kind": "quantize", "scheme": "int4_weight_only", "mode": "qat",
               "qat": {"max_steps": 3, "batch_size": 2, "learning_rate": 1e-3}}]
    path = causal_lm_recipe(tmp_path, tiny_llama_folder, stages, train_samples=40)
    run_dir = run_recipe(load_recipe(path, check_sources=True), echo=lambda _: None)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    metrics = manifest["stages"][0]["metrics"]
    assert metrics["train_steps"] == 3 and metrics["qat_linears"] == 2 * 7 + 1
    assert metrics["head_scheme"] == "int8_weight_only" and metrics["train_blocks"] > 0
    assert torch.isfinite(torch.tensor(metrics["train_loss"]))
    folder = run_dir / manifest["stages"][0]["outputs"][0]["model_dir"]
    facts = json.loads((folder / "causal_lm.json").read_text())
    assert (facts["scheme"], facts["head_scheme"]) == ("int4_weight_only", "int8_weight_only")
    saved = load_saved(folder).model
    kinds = {type(m.weight).__name__ for n, m in saved.named_modules()
             if isinstance(m, nn.Linear) and n != "lm_head"}
    assert kinds == {"Int4OpaqueTensor"}, kinds
    assert type(saved.lm_head.weight).__name__ != "Int4OpaqueTensor"

"""The bf16 precision stage: the cast, its recipe rules, and its refusal on CPUs without
native bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from conftest import digits_recipe, text_recipe

from compress.errors import UserError
from compress.measure.evaluate import logits_of
from compress.models.folders import load_saved, save_model
from compress.models.loading import load_model
from compress.pipeline.loop import check_hardware
from compress.recipe.kinds.precision import PrecisionConfig
from compress.recipe.registry import HARDWARE
from compress.recipe.schema import load_recipe
from compress.recipe.sources import resolve_model
from compress.stages.precision import cast


def test_cast_makes_every_weight_bf16_and_keeps_the_logits(tiny_bert: Path, tmp_path) -> None:
    bundle = load_model(resolve_model(str(tiny_bert)), ["neg", "pos"], [])
    inputs = dict(bundle.tokenizer(["a good film", "bad"], padding=True, return_tensors="pt"))
    with torch.inference_mode():
        before = logits_of(bundle.model, inputs)
        cast(bundle, PrecisionConfig())
        after = logits_of(bundle.model, inputs)
    assert {p.dtype for p in bundle.model.parameters()} == {torch.bfloat16}
    assert after.dtype == torch.bfloat16 and after.shape == before.shape
    assert float((after.float() - before).abs().max()) < 0.02
    save_model(bundle, tmp_path / "saved")  # loads back in bf16, half the bytes
    again = load_saved(tmp_path / "saved")
    assert {p.dtype for p in again.model.parameters()} == {torch.bfloat16}


def test_precision_after_quantize_and_on_a_factory_model_are_refused(tmp_path) -> None:
    raw = digits_recipe(tmp_path / "runs")
    raw["stages"] = [{"kind": "precision"}]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(UserError, match="casts Hugging Face models only"):
        load_recipe(path)


def test_quantize_after_precision_is_refused(tiny_bert: Path, tmp_path) -> None:
    path = text_recipe(tmp_path, tiny_bert, [{"kind": "precision"},
                                             {"kind": "quantize", "mode": "dynamic"}])
    with pytest.raises(UserError, match="a quantize stage cannot take the model of a "
                                        "precision stage"):
        load_recipe(path)


@pytest.mark.parametrize("native", [True, False])
def test_hardware_check_refuses_without_native_bf16(native: bool, tiny_bert: Path, tmp_path,
                                                    monkeypatch) -> None:
    text, _ = HARDWARE["bf16_cpu"]
    monkeypatch.setitem(HARDWARE, "bf16_cpu", (text, lambda: native))
    recipe = load_recipe(text_recipe(tmp_path, tiny_bert, [{"kind": "precision"}]))
    if native:
        check_hardware(recipe)
        return
    with pytest.raises(UserError) as refused:
        check_hardware(recipe)
    assert refused.value.messages == [
        "stages.0: this stage needs a CPU that computes bfloat16 natively (AVX512-BF16 or "
        "AMX; elsewhere bf16 is emulated and slower than fp32), and none is found on this "
        "machine; run the recipe where there is one"]

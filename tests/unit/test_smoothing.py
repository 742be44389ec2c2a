"""SmoothQuant's smoothing (compress/algorithms/smoothing.py): the float function is kept,
Linears reading one tensor share a scale, and only static mode takes it (its effect on
MiniLM's int8 embeddings: tests/integration/test_smoothing_minilm.py)."""

from __future__ import annotations

import pytest
import torch
from builders import input_ids, random_bert
from torch import nn

from compress.algorithms.smoothing import SmoothedLinear, input_statistics, smooth_linears
from compress.recipe.kinds.quantize import SPEC, QuantizeConfig


@torch.no_grad()
def test_smoothing_keeps_the_float_model_and_groups_query_key_value() -> None:
    model = random_bert()
    with torch.no_grad():  # an outlier channel in every hidden state
        model.bert.embeddings.LayerNorm.weight[5] *= 30.0
    ids = input_ids()
    before = model(input_ids=ids).logits
    absmax, groups = input_statistics(model, lambda: model(input_ids=ids))
    assert ["bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.0.attention.self.key",
            "bert.encoder.layer.0.attention.self.value"] in groups
    assert absmax["bert.encoder.layer.0.attention.self.query"][5] > 10 * float(
        absmax["bert.encoder.layer.0.attention.self.query"].median())
    count = smooth_linears(model, absmax, groups, 0.8, keep_float=["classifier"])
    attention = model.bert.encoder.layer[0].attention.self
    assert isinstance(attention.query, SmoothedLinear)
    assert attention.query.inv_scale is attention.value.inv_scale  # one multiply for three
    assert isinstance(model.classifier, nn.Linear)  # kept in float: not smoothed
    assert count == 2 * 6 + 1  # six Linears a layer and the pooler
    torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["dynamic", "qat"])
def test_smoothing_outside_static_mode_is_refused_in_one_line(mode: str) -> None:
    problems = SPEC.check_task(QuantizeConfig(mode=mode, smoothing=0.5), "classification", 2)
    assert problems == [f"stages.2.smoothing: SmoothQuant's scales come from the calibration "
                        f"of static mode, not {mode}; use `mode: static` or drop smoothing"]

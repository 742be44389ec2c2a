"""Stage `quantize` on an embedding model: PT2E int8 through the shared runner, the encoder
captured as one graph, pooling and normalization included. Dynamic and static as for
classifiers; QAT trains the fake-quantized encoder towards the float model's embeddings
(a frozen copy of the model entering the stage) by the distillation loss, |s - t|^2 +
1 - cos, on the train split's text: no labels are read."""

from __future__ import annotations

import copy

from compress.algorithms.quantization import quantize
from compress.families.embedding.stages.distill import make_loss_fn
from compress.recipe.kinds.quantize import QuantizeConfig
from compress.stages.context import StageContext, State


def run(state: State, cfg: QuantizeConfig, ctx: StageContext) -> State:
    """Quantize the encoder (dynamic, static or QAT towards its float embeddings), save
    `model.pt2`, record the figures."""
    qat = cfg.mode == "qat"
    loss_fn = make_loss_fn(copy.deepcopy(state.bundle.model).eval()) if qat else None
    bundle, metrics = quantize(state.bundle, cfg, ctx.data.splits.get("calibration"),
                               setup=ctx.training() if qat else None,
                               max_length=ctx.data.max_length, loss_fn=loss_fn)
    ctx.metrics.update(metrics)
    ctx.save_model(bundle)
    return State(bundle)

"""Stage `precision`: the current model cast to bfloat16 (weights and activations)."""

from __future__ import annotations

import time

import torch

from compress.errors import CompressError
from compress.models.bundle import ModelBundle
from compress.recipe.kinds.precision import PrecisionConfig
from compress.stages.context import StageContext, State

DTYPES = {"bf16": torch.bfloat16}


def cast(bundle: ModelBundle, cfg: PrecisionConfig) -> ModelBundle:
    """The bundle's Hugging Face model cast in place to `cfg.dtype` (its config records the
    dtype, so a saved copy loads back in it). CompressError for other model kinds."""
    if bundle.kind != "hf":
        raise CompressError(f"the precision stage casts Hugging Face models only, not a "
                            f"{bundle.kind} model")
    bundle.model.to(DTYPES[cfg.dtype]).eval()
    return bundle


def run(state: State, cfg: PrecisionConfig, ctx: StageContext) -> State:
    """Cast the model, save it, record `dtype` and `cast_s`."""
    began = time.perf_counter()
    bundle = cast(state.bundle, cfg)
    ctx.metrics.update(dtype=cfg.dtype, cast_s=round(time.perf_counter() - began, 3))
    ctx.save_model(bundle)
    return State(bundle)

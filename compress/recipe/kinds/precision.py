"""Stage kind `precision`: its config and spec (no torch import; run module: precision.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from compress.recipe.options import StageName, StrictModel
from compress.recipe.registry import StageSpec, register


class PrecisionConfig(StrictModel):
    """Cast weights and activations to bfloat16: no calibration, about half the fp32 time on
    CPUs that compute bf16 natively (AVX512-BF16 or AMX). Refused on other CPUs, where bf16
    matrix products are emulated and slower than fp32. Hugging Face models only."""

    kind: Literal["precision"] = "precision"
    name: StageName = None
    dtype: Literal["bf16"] = Field("bf16", description="The precision to cast to.")


def _hugging_face_only(recipe: Any, i: int) -> list[str]:
    """A `module:factory` model takes float inputs the cast would not follow: refused."""
    from compress.recipe.sources import is_factory  # sources imports the spec registry

    if is_factory(recipe.model.source):
        return [f"stages.{i}: the precision stage casts Hugging Face models only; "
                f"model.source {recipe.model.source} is a module:factory model"]
    return []


SPEC = register(StageSpec(
    kind="precision", config=PrecisionConfig, runner="compress.stages.precision:run",
    order=45, refused_before=("quantize", "precision"), check=_hugging_face_only,
    precision=lambda cfg: cfg.dtype, runtime=lambda config, metrics: "PyTorch eager bf16",
    needs=lambda cfg: ("bf16_cpu",),
))

"""Stage kind `quantize`: its config and spec (no torch import; run module: quantize.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from compress.stages.options import CalibrationOptions, StageName, StrictModel, TrainOptions
from compress.stages.spec import StageSpec, register


class QuantizeConfig(StrictModel):
    """int8 quantization through torch.export and torchao's PT2E flow (X86InductorQuantizer)."""

    kind: Literal["quantize"] = "quantize"
    name: StageName = None
    mode: Literal["dynamic", "static", "qat"] = Field(
        "static", description="dynamic activations, static (calibrated), or quantization-aware "
        "training.")
    per_channel: bool = Field(True, description="Per-channel weight scales.")
    keep_float: list[str] = Field(
        default_factory=list, description="Module name patterns left in float (fnmatch).")
    calibration: CalibrationOptions = Field(default_factory=CalibrationOptions)
    qat: TrainOptions = Field(
        default_factory=lambda: TrainOptions(max_steps=100, learning_rate=2e-5),
        description="Training options of mode qat.")
    compile: bool = Field(True, description="Evaluate through torch.compile with freezing.")


def _splits(cfg: QuantizeConfig) -> tuple[str, ...]:
    return {"dynamic": (), "static": ("calibration",), "qat": ("train", "calibration")}[cfg.mode]


def _runtime(config: dict, metrics: dict) -> str:
    compiled = ", torch.compile" if config.get("compile", True) else ""
    return f"PT2E int8 {config.get('mode', 'static')}{compiled}"


SPEC = register(StageSpec(
    kind="quantize", config=QuantizeConfig, runner="compress.stages.quantize:run", order=40,
    splits=_splits, refused_before=("quantize", "precision"), precision=lambda cfg: "int8",
    runtime=_runtime, reload="compress.stages.quantize:reload",
))

"""Stage kind `compile`: its config and spec (no torch import; run module: compile.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from compress.stages.options import StageName, StrictModel
from compress.stages.spec import StageSpec, register


class CompileConfig(StrictModel):
    """torch.compile of the current model; records compile time and latency after it."""

    kind: Literal["compile"] = "compile"
    name: StageName = None
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = (
        Field("default", description="torch.compile mode."))
    dynamic: bool | None = Field(None, description="Dynamic shapes (null: let torch decide).")
    freezing: bool = Field(True, description="Inductor freezing (constant-folds weights).")


SPEC = register(StageSpec(
    kind="compile", config=CompileConfig, runner="compress.stages.compile:run", order=50,
    runtime=lambda config, metrics: "torch.compile", reload="compress.stages.compile:reload",
))

"""Stage kind `compile`: its config and spec (no torch import; run module: compile.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from compress.recipe.options import StageName, StrictModel
from compress.recipe.registry import StageSpec, register


class CompileConfig(StrictModel):
    """torch.compile of the current model; records compile time and latency after it."""

    kind: Literal["compile"] = "compile"
    name: StageName = None
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = (
        Field("default", description="torch.compile mode."))
    dynamic: bool | None = Field(None, description="Dynamic shapes (null: let torch decide).")
    freezing: bool = Field(True, description="Inductor freezing (constant-folds weights).")


def _check_task(cfg: CompileConfig, task: str, index: int) -> list[str]:
    """A causal LM's decode step is compiled with static shapes and frozen weights."""
    if task != "causal-lm":
        return []
    problems = []
    if cfg.dynamic:
        problems.append(f"stages.{index}.dynamic: a causal LM's decode step has static "
                        "shapes (static KV cache); remove it")
    if not cfg.freezing:
        problems.append(f"stages.{index}.freezing: a causal LM's decode step is always "
                        "compiled with freezing (the int8/int4 weight kernels need it)")
    return problems


SPEC = register(StageSpec(
    kind="compile", config=CompileConfig, runner="compress.stages.compile:run", order=50,
    runtime=lambda config, metrics: "torch.compile", reload="compress.stages.compile:reload",
    check_task=_check_task,
))

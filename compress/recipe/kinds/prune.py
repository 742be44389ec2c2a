"""Stage kind `prune`: its config and spec (no torch import; run module: prune.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from compress.recipe.options import StageName, StrictModel, TrainOptions
from compress.recipe.registry import StageSpec, register


class PruneConfig(StrictModel):
    """Magnitude pruning: unstructured (per layer), global (one threshold), or structured."""

    kind: Literal["prune"] = "prune"
    name: StageName = None
    method: Literal["unstructured", "global", "structured"] = Field(
        "unstructured", description="unstructured: L1 per layer; global: one threshold across "
        "layers; structured: remove whole neurons, heads or channels.")
    amount: float = Field(0.5, gt=0, lt=1, description="Share of weights (or units) to remove.")
    target: Literal["ffn", "heads", "ffn+heads", "channels"] = Field(
        "ffn", description="Structured only: feed-forward neurons, heads, or CNN channels.")
    include: list[str] = Field(
        default_factory=lambda: ["*"], description="Module name patterns to prune (fnmatch).")
    exclude: list[str] = Field(
        default_factory=lambda: ["*embeddings*", "*classifier*", "*pooler*"],
        description="Module name patterns never pruned (embeddings and the head by default).")
    recovery: TrainOptions | None = Field(
        None, description="Fine-tune after pruning (masks kept) to recover accuracy.")
    gradual: bool = Field(
        False, description="Raise sparsity step by step over the recovery steps (needs recovery).")

    @model_validator(mode="after")
    def _gradual_needs_recovery(self) -> PruneConfig:
        if self.gradual and self.recovery is None:
            raise ValueError("gradual: true needs recovery (the steps over which sparsity rises)")
        if self.gradual and self.method == "structured":
            raise ValueError("gradual: true works with unstructured and global pruning only")
        return self


def _runtime(config: dict, metrics: dict) -> str:
    return "PyTorch eager (pruned)"


def _check_task(cfg: PruneConfig, task: str, index: int) -> list[str]:
    """A causal LM is pruned structurally, by neurons and key-value groups, in every layer."""
    if task != "causal-lm":
        return []
    where = f"stages.{index}"
    problems = []
    if cfg.method != "structured":
        problems.append(f"{where}.method: a causal LM is pruned with method: structured "
                        "(whole feed-forward neurons or key-value groups of heads); "
                        f"{cfg.method} zeros weights a decoder cannot skip")
    if cfg.target == "channels":
        problems.append(f"{where}.target: channels are a CNN's; a causal LM takes ffn, heads "
                        "or ffn+heads")
    problems += [f"{where}.{o}: a classifier's option; a causal LM prunes the same units in "
                 "every decoder layer" for o in ("include", "exclude", "gradual")
                 if o in cfg.model_fields_set]
    return problems


SPEC = register(StageSpec(
    kind="prune", config=PruneConfig, runner="compress.stages.prune:run", order=30,
    splits=lambda cfg: ("train",) if cfg.recovery else (), refused_before=("quantize",),
    runtime=_runtime, check_task=_check_task,
))

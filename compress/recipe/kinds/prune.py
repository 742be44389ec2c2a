"""Stage kind `prune`: its config and spec (no torch import; run module: prune.py)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from compress.recipe.options import CalibrationOptions, StageName, StrictModel, TrainOptions
from compress.recipe.registry import StageSpec, register

MAX_GROUP = 32  # the widest n:m group (m) a pattern may name
SEMI_ONLY = ("pattern", "scoring", "calibration")  # options of method semi_structured alone
NOT_SEMI = ("amount", "target", "gradual")  # options that semi_structured's pattern replaces
DISTILL_ONLY = ("temperature", "alpha")


def parse_pattern(pattern: str) -> tuple[int, int]:
    """(n, m) of an "n:m" pattern (n kept weights in every m consecutive inputs)."""
    n, m = pattern.split(":")
    return int(n), int(m)


class PruneConfig(StrictModel):
    """Magnitude pruning: unstructured (per layer), global (one threshold), structured, or
    semi-structured n:m (n of every m consecutive input weights kept)."""

    kind: Literal["prune"] = "prune"
    name: StageName = None
    method: Literal["unstructured", "global", "structured", "semi_structured"] = Field(
        "unstructured", description="unstructured: L1 per layer; global: one threshold across "
        "layers; structured: remove whole neurons, heads or channels; semi_structured: keep "
        "`pattern`'s n of every m consecutive weights along each Linear's inputs.")
    amount: float = Field(0.5, gt=0, lt=1, description="Share of weights (or units) to remove.")
    target: Literal["ffn", "heads", "ffn+heads", "channels"] = Field(
        "ffn", description="Structured only: feed-forward neurons, heads, or CNN channels.")
    pattern: str = Field(
        "2:4", description="semi_structured only: n:m, n kept of every m consecutive input "
        "weights (0 < n < m <= 32); YAML reads an unquoted 2:4 as the base-60 number 124, "
        "which is taken back as 2:4.")
    scoring: Literal["magnitude", "wanda"] = Field(
        "magnitude", description="semi_structured only: which weights of a group stay: the "
        "largest |W|, or wanda: |W| times the L2 norm of its input over the calibration "
        "split (Sun et al., 2023).")
    calibration: CalibrationOptions = Field(
        default_factory=CalibrationOptions,
        description="scoring wanda only: the calibration examples whose inputs are measured.")
    include: list[str] = Field(
        default_factory=lambda: ["*"], description="Module name patterns to prune (fnmatch).")
    exclude: list[str] = Field(
        default_factory=lambda: ["*embeddings*", "*classifier*", "*pooler*"],
        description="Module name patterns never pruned (embeddings and the head by default).")
    recovery: TrainOptions | None = Field(
        None, description="Fine-tune after pruning (masks kept) to recover accuracy.")
    recovery_distill: bool = Field(
        False, description="Recovery learns the entering (dense) model's outputs: T^2 x KL "
        "at `temperature` plus alpha x the task loss (classifiers: logits and labels; causal "
        "LMs: next-token distributions), the masks kept.")
    temperature: float = Field(
        2.0, gt=0, le=1000, description="recovery_distill: softmax temperature T of the KL.")
    alpha: float = Field(
        0.5, ge=0, le=1, description="recovery_distill: weight of the task loss; "
        "(1 - alpha) * T^2 weighs the KL term.")
    gradual: bool = Field(
        False, description="Raise sparsity step by step over the recovery steps (needs recovery).")

    @field_validator("pattern", mode="before")
    @classmethod
    def _base60(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return f"{value // 60}:{value % 60}"  # YAML 1.1's sexagesimal reading of n:m
        return value

    @field_validator("pattern")
    @classmethod
    def _n_of_m(cls, value: str) -> str:
        if not re.fullmatch(r"\d+:\d+", value.strip()):
            raise ValueError(f"pattern '{value}' is not n:m (two whole numbers, like \"2:4\")")
        n, m = parse_pattern(value.strip())
        if not 0 < n < m <= MAX_GROUP:
            raise ValueError(f"pattern {n}:{m}: needs 0 < n < m <= {MAX_GROUP} (n kept of "
                             "every m weights)")
        return f"{n}:{m}"

    @model_validator(mode="after")
    def _combinations(self) -> PruneConfig:
        given = self.model_fields_set
        if self.gradual and self.recovery is None:
            raise ValueError("gradual: true needs recovery (the steps over which sparsity rises)")
        if self.gradual and self.method == "structured":
            raise ValueError("gradual: true works with unstructured and global pruning only")
        if self.method == "semi_structured":
            wrong = [o for o in NOT_SEMI if o in given]
            if wrong:
                raise ValueError(f"{', '.join(wrong)}: not an option of method semi_structured "
                                 f"(pattern {self.pattern} sets the sparsity, in every Linear)")
        else:
            wrong = [o for o in SEMI_ONLY if o in given]
            if wrong:
                raise ValueError(f"{', '.join(wrong)}: an option of method semi_structured "
                                 f"only (method is {self.method})")
        if "calibration" in given and self.scoring != "wanda":
            raise ValueError("calibration: only scoring wanda reads calibration examples")
        if self.recovery_distill and self.recovery is None:
            raise ValueError("recovery_distill: true needs recovery (the training it changes)")
        wrong = [o for o in DISTILL_ONLY if o in given and not self.recovery_distill]
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: options of recovery_distill: true only")
        return self

    @property
    def n_m(self) -> tuple[int, int]:
        """(n, m) of `pattern`."""
        return parse_pattern(self.pattern)


def _runtime(config: dict, metrics: dict) -> str:
    if config.get("method") == "semi_structured":
        sparsity = metrics.get("sparsity_layers")
        exact = f", {sparsity:.1%} of pruned weights zero" if sparsity is not None else ""
        return f"PyTorch eager ({config.get('pattern', '2:4')} pruned{exact})"
    return "PyTorch eager (pruned)"


def _splits(cfg: PruneConfig) -> tuple[str, ...]:
    wanda = cfg.method == "semi_structured" and cfg.scoring == "wanda"
    return (("train",) if cfg.recovery else ()) + (("calibration",) if wanda else ())


def _check_task(cfg: PruneConfig, task: str, index: int) -> list[str]:
    """A causal LM is pruned structurally, by neurons and key-value groups, in every layer,
    or n:m in every decoder Linear; an embedding model's prune has no scoring or
    recovery_distill, a reranker's no recovery_distill."""
    where = f"stages.{index}"
    if task == "embedding":  # its prune stage always recovers towards the entering model
        wrong = {"scoring": cfg.scoring == "wanda", "recovery_distill": cfg.recovery_distill}
        return [f"{where}.{o}: not an option of an embedding model's prune (its recovery "
                "always distils the entering model's embeddings; scoring is magnitude)"
                for o, bad in wrong.items() if bad]
    if task == "reranking":  # the same: its recovery learns the entering model's scores
        return [f"{where}.{o}: not an option of a reranker's prune (its recovery always "
                "learns the entering model's score logits by MSE)"
                for o in ("recovery_distill", "temperature", "alpha")
                if o in cfg.model_fields_set]
    if task != "causal-lm":
        return []
    problems = []
    if cfg.method not in ("structured", "semi_structured"):
        problems.append(f"{where}.method: a causal LM is pruned with method: structured "
                        "(whole feed-forward neurons or key-value groups of heads) or "
                        "semi_structured (n:m in every decoder Linear); "
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
    splits=_splits, refused_before=("quantize",), runtime=_runtime, check_task=_check_task,
))

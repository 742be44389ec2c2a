"""Stage kind `moefy`: its config and spec (no torch import; run module: the causal-LM
family's `stages/moefy.py`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from compress.recipe.options import CalibrationOptions, StageName, StrictModel, TrainOptions
from compress.recipe.registry import StageSpec, register

DISTILL_ONLY = ("temperature", "alpha")


class MoefyCalibration(CalibrationOptions):
    """The calibration blocks the split and the routers learn from."""

    samples: int = Field(
        64, ge=2, le=10**7, description="Blocks of data.max_length calibration tokens (an "
        "eighth of them, one block at least and 4 batches at most, held out to measure the "
        "routers).")
    batch_size: int = Field(8, ge=1, le=4096, description="Blocks per calibration pass.")


class MoefyConfig(StrictModel):
    """MoEfication: split each SwiGLU feed-forward layer of a dense causal LM into equal
    experts, train a top-k router per layer, and recover by distilling the dense model."""

    kind: Literal["moefy"] = "moefy"
    name: StageName = None
    experts: int = Field(
        8, ge=2, le=1024, description="Experts per layer (E); each gets intermediate_size / E "
        "neurons, so E must divide the feed-forward width.")
    top_k: int = Field(
        2, ge=1, le=1024, description="Experts each token runs through (k <= experts).")
    split: Literal["coactivation", "contiguous"] = Field(
        "coactivation", description="coactivation: balanced k-means of the neurons' "
        "activation patterns on calibration text (neurons that fire together share an expert, "
        "MoEfication); contiguous: neurons 0..I/E-1 to expert 0 and so on.")
    cluster_tokens: int = Field(
        4096, ge=16, le=10**6, description="Calibration tokens whose activations describe "
        "each neuron for the coactivation split.")
    calibration: MoefyCalibration = Field(
        default_factory=MoefyCalibration,
        description="The calibration blocks (data.max_length tokens each) the split and the "
        "routers are trained on.")
    router_steps: int = Field(
        100, ge=1, le=10**6, description="Optimizer steps training the routers (all layers at "
        "once, on the dense model's feed-forward inputs).")
    router_learning_rate: float = Field(
        1e-2, gt=0, le=10, description="Peak AdamW learning rate of the routers.")
    router_batch_size: int = Field(
        8, ge=1, le=4096, description="Calibration blocks per router training step.")
    recovery: TrainOptions | None = Field(
        None, description="Train the MoE model after moefication (routers frozen) on the "
        "packed train text to recover perplexity.")
    recovery_distill: bool = Field(
        True, description="Recovery learns the dense model's next-token distributions: "
        "(1 - alpha) x T^2 x KL at `temperature` plus alpha x the next-token loss.")
    temperature: float = Field(
        1.0, gt=0, le=1000, description="recovery_distill: softmax temperature T of the KL.")
    alpha: float = Field(
        0.5, ge=0, le=1, description="recovery_distill: weight of the next-token loss.")

    @model_validator(mode="after")
    def _combinations(self) -> MoefyConfig:
        if self.top_k > self.experts:
            raise ValueError(f"top_k {self.top_k} is more than experts {self.experts}; "
                             "give top_k <= experts")
        wrong = [o for o in DISTILL_ONLY if o in self.model_fields_set
                 and not (self.recovery_distill and self.recovery is not None)]
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: options of a distilling recovery only (set "
                             "recovery and recovery_distill: true)")
        return self


def _splits(cfg: MoefyConfig) -> tuple[str, ...]:
    return ("calibration",) + (("train",) if cfg.recovery else ())


def _runtime(config: dict[str, Any], metrics: dict[str, Any]) -> str:
    return (f"PyTorch eager (Mixtral MoE, top-{config.get('top_k', 2)} of "
            f"{config.get('experts', 8)} experts)")


def _check_task(cfg: MoefyConfig, task: str, index: int) -> list[str]:
    """Only a causal LM has SwiGLU feed-forward layers to split."""
    if task == "causal-lm":
        return []
    return [f"stages.{index} (moefy): moefication splits a causal LM's SwiGLU feed-forward "
            f"layers into experts; this model is not one (model.task: {task}); remove the stage"]


def _fits_the_model(recipe: Any, index: int, config: dict[str, Any]) -> list[str]:
    """experts must divide the model's feed-forward width (from its config.json; not
    checked after an earlier stage that may change the width)."""
    from compress.recipe.chain import model_chain

    cfg = recipe.stages[index]
    width = config.get("intermediate_size")
    reshaped = any(getattr(recipe.stages[j], "method", "") == "structured"
                   or getattr(recipe.stages[j], "student", None) is not None
                   for j in model_chain(recipe, index))
    if reshaped or not isinstance(width, int) or width % cfg.experts == 0:
        return []
    fits = [e for e in range(2, min(width, 64) + 1) if width % e == 0][:6]
    return [f"stages.{index}.experts: {cfg.experts} does not divide the feed-forward width "
            f"{width} (intermediate_size); choose one of {', '.join(map(str, fits))}, ..."]


SPEC = register(StageSpec(
    kind="moefy", config=MoefyConfig, runner="compress.families.causal_lm.stages.moefy:run",
    order=35, splits=_splits, refused_before=("quantize",), runtime=_runtime,
    check_task=_check_task, check_model=_fits_the_model,
))

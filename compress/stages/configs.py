"""Stage configuration classes: one pydantic model per stage kind (no torch import here).

Each stage kind is one config class here plus one plain function
`run(state, cfg, ctx) -> state` in `compress/stages/<kind>.py`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field


class StrictModel(BaseModel):
    """Frozen, unknown keys forbidden: the base of every recipe section."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainOptions(StrictModel):
    """Options of the shared training loop (finetune, distill, QAT)."""

    epochs: float = Field(1.0, gt=0, description="Passes over the train split (fractions allowed).")
    max_steps: int | None = Field(
        None, ge=1, description="Optimizer steps; when set, overrides epochs."
    )
    batch_size: int = Field(32, ge=1, le=4096, description="Examples per forward pass.")
    grad_accum_steps: int = Field(
        1, ge=1, description="Forward passes per optimizer step (batch_size x this per step)."
    )
    learning_rate: float = Field(5e-5, gt=0, le=1.0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    warmup_ratio: float = Field(
        0.1, ge=0, le=1, description="Share of steps warming up linearly, then linear decay."
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the gradient norm to this value (null: no clipping)."
    )
    bf16: bool = Field(False, description="Train under bfloat16 autocast (AVX512-BF16 / AMX).")
    checkpoint_every: int = Field(
        50, ge=1, description="Save a resumable checkpoint every N optimizer steps."
    )
    seed: int | None = Field(None, description="Seed of this stage (default: the recipe's seed).")


class FinetuneConfig(TrainOptions):
    """Supervised fine-tuning of the current model on the train split (cross-entropy)."""

    kind: Literal["finetune"] = "finetune"
    name: str | None = Field(None, description="Display name of the stage (default: its kind).")

    needs_before: ClassVar[tuple[str, ...]] = ()
    uses_splits: ClassVar[tuple[str, ...]] = ("train",)


STAGE_CONFIGS: dict[str, type[StrictModel]] = {
    "finetune": FinetuneConfig,
}

# kind -> "module:function", imported only when the stage runs (keeps `validate` torch-free).
STAGE_RUNNERS: dict[str, str] = {
    "finetune": "compress.stages.finetune:run",
}


def stage_doc(kind: str) -> str:
    """The one-line description of a stage kind."""
    doc = STAGE_CONFIGS[kind].__doc__ or ""
    return doc.strip().splitlines()[0]

"""Config pieces shared by stage kinds (no torch import): the strict base model, the
training loop's options and calibration options."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

StageName = Annotated[
    str | None, Field(description="Display name of the stage (default: its kind).")]


class StrictModel(BaseModel):
    """Frozen, unknown keys forbidden, finite numbers only: the base of every recipe section."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TrainOptions(StrictModel):
    """Options of the shared training loop (finetune, distill, QAT)."""

    epochs: float = Field(
        1.0, gt=0, le=10_000, description="Passes over the train split (fractions allowed).")
    max_steps: int | None = Field(
        None, ge=1, le=10**9, description="Optimizer steps; when set, overrides epochs."
    )
    batch_size: int = Field(32, ge=1, le=4096, description="Examples per forward pass.")
    grad_accum_steps: int = Field(
        1, ge=1, le=10_000,
        description="Forward passes per optimizer step (batch_size x this per step).")
    learning_rate: float = Field(5e-5, gt=0, le=1.0, description="Peak AdamW learning rate.")
    weight_decay: float = Field(0.01, ge=0, le=10, description="AdamW weight decay.")
    warmup_ratio: float = Field(
        0.1, ge=0, le=1, description="Share of steps warming up linearly, then linear decay."
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the gradient norm to this value (null: no clipping)."
    )
    bf16: bool = Field(False, description="Train under bfloat16 autocast (AVX512-BF16 / AMX).")
    checkpoint_every: int = Field(
        50, ge=1, le=10**9, description="Save a resumable checkpoint every N optimizer steps."
    )
    seed: int | None = Field(
        None, ge=0, lt=2**32, description="Seed of this stage (default: the recipe's seed).")
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp", description="Under `compress run --nproc N`: ddp (a replica per process) or fsdp "
        "(parameters, gradients and optimizer state sharded per transformer block; sharded "
        "checkpoints that resume on any number of processes).")
    mixed_precision: Literal["none", "bf16"] = Field(
        "none", description="With parallel: fsdp, bf16 gathers and computes parameters in "
        "bf16 and reduces gradients in fp32 (FSDP's MixedPrecisionPolicy).")
    activation_checkpointing: bool = Field(
        False, description="Keep only each transformer block's inputs and recompute its "
        "activations in backward: less memory, more time.")

    @model_validator(mode="after")
    def _mixed_precision_needs_fsdp(self) -> TrainOptions:
        if self.mixed_precision != "none" and self.parallel != "fsdp":
            raise ValueError("mixed_precision is FSDP's policy: set parallel: fsdp with it, or "
                             "use bf16: true (autocast) under ddp")
        return self


class CalibrationOptions(StrictModel):
    """Calibration of static quantization."""

    samples: int = Field(
        256, ge=1, le=10**7, description="Examples of the calibration split to observe.")
    batch_size: int = Field(32, ge=1, le=4096, description="Batch size of the calibration passes.")

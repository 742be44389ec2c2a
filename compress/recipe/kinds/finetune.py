"""Stage kind `finetune`: its config and spec (no torch import; run module: finetune.py)."""

from __future__ import annotations

from typing import Literal

from compress.recipe.options import StageName, TrainOptions
from compress.recipe.registry import StageSpec, register


class FinetuneConfig(TrainOptions):
    """Supervised fine-tuning of the current model on the train split (cross-entropy; for a
    causal LM, next-token cross-entropy over the text packed into blocks)."""

    kind: Literal["finetune"] = "finetune"
    name: StageName = None


SPEC = register(StageSpec(
    kind="finetune", config=FinetuneConfig, runner="compress.stages.finetune:run", order=10,
    data_parallel=True, reference=True, splits=lambda cfg: ("train",),
    refused_before=("quantize",),
))

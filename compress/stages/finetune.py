"""Stage `finetune`: supervised training of the current model with the shared loop."""

from __future__ import annotations

from compress.recipe.kinds.finetune import FinetuneConfig
from compress.stages.context import StageContext, State


def run(state: State, cfg: FinetuneConfig, ctx: StageContext) -> State:
    """Train the current model on the train split, save it, and record the training figures."""
    bundle = state.bundle
    result = ctx.training().run(bundle.model, cfg, bundle.tokenizer)
    ctx.metrics.update(result.figures())
    ctx.metrics.update(result.parallel_metrics())
    ctx.save_model(bundle)
    return State(bundle)

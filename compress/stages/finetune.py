"""Stage `finetune`: supervised training of the current model with the shared loop."""

from __future__ import annotations

from compress.stages.configs import FinetuneConfig
from compress.state import StageContext, State
from compress.train import train


def run(state: State, cfg: FinetuneConfig, ctx: StageContext) -> State:
    """Train the current model on the train split, save it, and record the training figures."""
    bundle = state.bundle
    result = train(
        bundle.model, ctx.data.splits["train"], cfg, seed=ctx.seed,
        checkpoint_dir=ctx.checkpoint_dir, key=ctx.key, tokenizer=bundle.tokenizer,
        max_length=ctx.data.max_length, desc=ctx.name)
    ctx.metrics.update(
        train_steps=result.steps, train_loss=result.final_loss,
        train_examples_per_s=result.examples_per_s, resumed_from_step=result.resumed_from)
    ctx.metrics.update(result.parallel_metrics())
    ctx.save_model(bundle)
    return State(bundle)

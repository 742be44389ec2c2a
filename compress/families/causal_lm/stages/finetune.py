"""Stage `finetune` on a causal LM: next-token cross-entropy over the train split's text,
packed into `data.max_length` blocks, with the shared training loop."""

from __future__ import annotations

from compress.errors import CompressError
from compress.families.causal_lm.algorithms.distill import causal_lm_loss, packed_examples
from compress.recipe.kinds.finetune import FinetuneConfig
from compress.stages.context import StageContext, State


def run(state: State, cfg: FinetuneConfig, ctx: StageContext) -> State:
    """Train the current causal LM on the train text, save it, record the figures."""
    bundle = state.bundle
    if (bundle.causal_lm_facts or {}).get("scheme"):
        raise CompressError("finetune needs a float model; fine-tune before quantize")
    setup = ctx.training()
    try:
        setup.examples = packed_examples(bundle.tokenizer, setup.examples.texts,
                                         ctx.data.max_length)
    except ValueError as exc:
        raise CompressError(str(exc)) from None
    for p in bundle.model.parameters():
        p.requires_grad_(True)
    result = setup.run(bundle.model, cfg, None, loss_fn=causal_lm_loss)
    ctx.metrics.update({"train_blocks": len(setup.examples), **result.figures(),
                        **result.parallel_metrics()})
    ctx.save_model(bundle)
    return State(bundle)

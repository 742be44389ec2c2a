"""Stage `prune` on a causal LM: structured only
(`compress.families.causal_lm.algorithms.pruning`): whole feed-forward neurons and/or whole
key-value groups of heads, the same number in every layer, then an optional recovery fine-tune
(next-token loss on the packed train text)."""

from __future__ import annotations

from compress.errors import CompressError
from compress.families.causal_lm.algorithms.distill import lm_loss, packed_examples
from compress.families.causal_lm.algorithms.pruning import prune_lm
from compress.models.bundle import count_params
from compress.recipe.kinds.prune import PruneConfig
from compress.stages.context import StageContext, State


def run(state: State, cfg: PruneConfig, ctx: StageContext) -> State:
    """Prune the current causal LM, recover it if asked, save it, record the figures."""
    bundle = state.bundle
    if (bundle.lm or {}).get("scheme"):
        raise CompressError("prune needs a float model; prune before quantize")
    before = count_params(bundle.model)
    try:
        widths = prune_lm(bundle.model, cfg.target, cfg.amount)
    except ValueError as exc:
        raise CompressError(str(exc)) from None
    after = count_params(bundle.model)
    ctx.metrics.update(params_before=before, params_after=after,
                       param_reduction=round(1 - after / before, 4), **widths)
    ctx.log(f"{ctx.name}: {before / 1e6:.1f} M -> {after / 1e6:.1f} M parameters ({widths})")
    if cfg.recovery is not None:
        setup = ctx.training(desc=f"{ctx.name} recovery")
        setup.examples = packed_examples(bundle.tokenizer, setup.examples.texts,
                                         ctx.data.max_length)
        for p in bundle.model.parameters():
            p.requires_grad_(True)
        result = setup.run(bundle.model, cfg.recovery, None, loss_fn=lm_loss)
        ctx.metrics.update({**result.figures(), **result.parallel_metrics()})
    ctx.save_model(bundle)
    return State(bundle)

"""Stage `prune` on a causal LM: structured (`compress.families.causal_lm.algorithms.pruning`):
whole feed-forward neurons and/or whole key-value groups of heads, the same number in every
layer; or semi-structured n:m (`compress.algorithms.semi_structured`): n of every m
consecutive input weights kept in every decoder Linear (q/k/v/o, gate/up/down; never the
embeddings or the output head), by magnitude or Wanda's |W| x input norm on calibration text.
Then an optional recovery fine-tune on the packed train text: next-token loss, or with
`recovery_distill` the entering model's next-token distributions; n:m masks hold through it."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from compress.algorithms.pruning import apply_masks
from compress.algorithms.semi_structured import input_norms, prune_n_m, split_by_group
from compress.errors import CompressError
from compress.families.causal_lm.algorithms.distill import (
    causal_lm_loss,
    decoder_layers,
    make_causal_lm_kd_loss_fn,
    packed_examples,
)
from compress.families.causal_lm.algorithms.pruning import prune_causal_lm
from compress.families.causal_lm.family import PPL_BATCH, calibration_blocks
from compress.families.causal_lm.model import perplexity
from compress.models.bundle import ModelBundle, count_params
from compress.recipe.kinds.prune import PruneConfig
from compress.stages.context import StageContext, State
from compress.stages.prune import n_m_figures


def run(state: State, cfg: PruneConfig, ctx: StageContext) -> State:
    """Prune the current causal LM, recover it if asked, save it, record the figures."""
    bundle = state.bundle
    if (bundle.causal_lm_facts or {}).get("scheme"):
        raise CompressError("prune needs a float model; prune before quantize")
    teacher = copy.deepcopy(bundle.model).eval() if cfg.recovery_distill else None
    if cfg.method == "semi_structured":
        return run_semi_structured(bundle, cfg, ctx, teacher)
    before = count_params(bundle.model)
    try:
        widths = prune_causal_lm(bundle.model, cfg.target, cfg.amount)
    except ValueError as exc:
        raise CompressError(str(exc)) from None
    after = count_params(bundle.model)
    ctx.metrics.update(params_before=before, params_after=after,
                       param_reduction=round(1 - after / before, 4), **widths)
    ctx.log(f"{ctx.name}: {before / 1e6:.1f} M -> {after / 1e6:.1f} M parameters ({widths})")
    if cfg.recovery is not None:
        recover(bundle, cfg, ctx, teacher)
    ctx.save_model(bundle)
    return State(bundle)


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every Linear inside the decoder layers (`model.layers.<i>.…`), by its full name."""
    layers = decoder_layers(model)
    prefix = next(name for name, module in model.named_modules() if module is layers)
    return {f"{prefix}.{name}": module for name, module in layers.named_modules()
            if isinstance(module, nn.Linear)}


def _forward(model: nn.Module, ids: torch.Tensor) -> Any:
    return model(input_ids=ids)


def wanda_norms(bundle: ModelBundle, linears: dict[str, nn.Linear], cfg: PruneConfig,
                ctx: StageContext) -> dict[str, torch.Tensor]:
    """Input norms of `linears` over the calibration text, packed into `data.max_length`
    blocks (`calibration.samples` blocks at most, `calibration.batch_size` per pass)."""
    blocks = calibration_blocks(bundle.tokenizer, ctx.data, "scoring wanda")
    batches = blocks[:cfg.calibration.samples].split(cfg.calibration.batch_size)
    return input_norms(bundle.model, linears, batches, _forward)


def run_semi_structured(bundle: ModelBundle, cfg: PruneConfig, ctx: StageContext,
                        teacher: nn.Module | None) -> State:
    """n:m pruning of every decoder Linear, then recovery (towards `teacher` when given)
    with the masks re-applied after every step; the figures: the pattern, exact sparsity,
    Linears pruned and skipped, perplexity before recovery."""
    model, (n, m) = bundle.model, cfg.n_m
    try:
        layers = decoder_linears(model)
    except (ValueError, StopIteration) as exc:
        raise CompressError(f"pattern {cfg.pattern}: {exc}") from None
    norms = None
    if cfg.scoring == "wanda":
        norms = wanda_norms(bundle, split_by_group(layers, m)[0], cfg, ctx)
    masks, pruned, skipped = prune_n_m(layers, n, m, norms)
    if not pruned:
        raise CompressError(f"pattern {cfg.pattern}: no decoder Linear has a multiple of {m} "
                            "inputs")
    ctx.log(f"{ctx.name}: {cfg.pattern} ({cfg.scoring}) in {len(pruned)} decoder Linears"
            + (f", {len(skipped)} left dense (inputs not a multiple of {m})" if skipped else ""))
    if cfg.recovery is not None:
        texts, length = ctx.data.splits["eval"].texts, ctx.data.max_length
        pruned_ppl = perplexity(model.eval(), bundle.tokenizer, texts, length, PPL_BATCH)
        ctx.metrics["perplexity_pruned"] = round(pruned_ppl["perplexity"], 4)
        recover(bundle, cfg, ctx, teacher, on_step=lambda step: apply_masks(pruned, masks))
    apply_masks(pruned, masks)  # exact pattern, even if recovery resumed from a checkpoint
    ctx.metrics.update(n_m_figures(cfg, pruned, skipped))
    bundle.causal_lm_facts = {**(bundle.causal_lm_facts or {}), "sparsity_pattern": cfg.pattern}
    ctx.save_model(bundle)
    return State(bundle)


def recover(bundle: ModelBundle, cfg: PruneConfig, ctx: StageContext,
            teacher: nn.Module | None, **kwargs: Any) -> None:
    """Recovery fine-tune on the packed train text: next-token loss, or against `teacher`'s
    next-token distributions; `kwargs` (on_step) go to the training loop."""
    setup = ctx.training(desc=f"{ctx.name} recovery")
    setup.examples = packed_examples(bundle.tokenizer, setup.examples.texts,
                                     ctx.data.max_length)
    for p in bundle.model.parameters():
        p.requires_grad_(True)
    loss_fn = causal_lm_loss if teacher is None else make_causal_lm_kd_loss_fn(
        teacher, cfg.temperature, cfg.alpha)
    result = setup.run(bundle.model, cfg.recovery, None, loss_fn=loss_fn, **kwargs)
    ctx.metrics.update({**result.figures(), **result.parallel_metrics()})

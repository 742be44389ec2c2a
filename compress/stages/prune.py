"""Stage `prune`: magnitude pruning of the current model, then optional recovery training.

Unstructured and global pruning zero weights (the model keeps its shapes: no speedup is
claimed); during recovery the zeros are re-applied after every optimizer step, and with
`gradual` the sparsity rises on a cubic schedule. Structured pruning makes the model
physically smaller and records its new shapes in `bundle.structure`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from compress.bench import example_inputs
from compress.errors import StageError
from compress.models import ModelBundle, count_params
from compress.pruning import (
    Masks,
    apply_masks,
    count_macs,
    cubic_sparsity,
    layer_sparsity,
    merge_structure,
    overall_sparsity,
    prune_magnitude,
    prune_structured,
    select_layers,
)
from compress.stages.configs import PruneConfig
from compress.state import StageContext, State
from compress.train import total_steps, train

FLOPS_SEQ_LEN = 128
REPRUNE_TIMES = 10  # how often gradual pruning raises the sparsity over the recovery steps


def run(state: State, cfg: PruneConfig, ctx: StageContext) -> State:
    """Prune the current model, recover it if asked, save it, and record the figures."""
    bundle = state.bundle
    model = bundle.model
    layers = select_layers(model, cfg.include, cfg.exclude)
    if not layers:
        raise StageError(ctx.name, f"no layer matches include {cfg.include} minus exclude "
                         f"{cfg.exclude} (prunable: Linear and Conv2d modules)")
    example = flops_example(bundle)
    params_before, flops_before = count_params(model), count_macs(model, example)
    try:
        if cfg.method == "structured":
            pruned, shapes = prune_structured(model, layers, cfg.target, cfg.amount)
            bundle.structure = merge_structure(bundle.structure, shapes)
            on_step = None
        else:
            pruned, on_step = prune_in_place(layers, cfg, ctx)
    except ValueError as exc:
        raise StageError(ctx.name, str(exc)) from None
    if cfg.recovery is not None:
        recover(bundle, cfg, ctx, on_step)
    if cfg.method != "structured":
        prune_magnitude(layers, cfg.amount, cfg.method)  # exact final sparsity, even if resumed
    ctx.metrics.update(
        sparsity_target=cfg.amount, sparsity_layers=overall_sparsity(layers),
        sparsity_per_layer=layer_sparsity(layers), params_before=params_before,
        params_after=count_params(model), flops_before=flops_before,
        flops_after=count_macs(model, example), pruned_layers=len(pruned))
    ctx.save_model(bundle)
    return State(bundle)


def prune_in_place(layers: dict[str, nn.Module], cfg: PruneConfig,
                   ctx: StageContext) -> tuple[list[str], Callable[[int], None]]:
    """Prune now (or set up gradual pruning); return the layer names and the step callback."""
    if cfg.gradual:
        assert cfg.recovery is not None  # the config validator guarantees it
        steps = total_steps(len(ctx.data.splits["train"]), cfg.recovery)
        return list(layers), GradualPruner(layers, cfg.method, cfg.amount, steps)
    masks = prune_magnitude(layers, cfg.amount, cfg.method)
    return list(layers), lambda step: apply_masks(layers, masks)


class GradualPruner:
    """Step callback: re-prune on a cubic schedule at regular intervals, keep the zeros between."""

    def __init__(self, layers: dict[str, nn.Module], method: str, amount: float, steps: int):
        self.layers, self.method, self.amount, self.steps = layers, method, amount, steps
        self.interval = max(1, steps // REPRUNE_TIMES)
        self.masks: Masks = {name: m.weight.detach() != 0 for name, m in layers.items()}

    def __call__(self, step: int) -> None:
        if step % self.interval == 0 or step >= self.steps:
            sparsity = cubic_sparsity(step, self.steps, self.amount)
            self.masks = prune_magnitude(self.layers, sparsity, self.method)
        apply_masks(self.layers, self.masks)


def recover(bundle: ModelBundle, cfg: PruneConfig, ctx: StageContext,
            on_step: Callable[[int], None] | None) -> None:
    """Fine-tune the pruned model on the train split with `cfg.recovery` options."""
    opts = cfg.recovery
    assert opts is not None
    seed = opts.seed if opts.seed is not None else ctx.seed
    result = train(
        bundle.model, ctx.data.splits["train"], opts, seed=seed,
        checkpoint_dir=ctx.checkpoint_dir, key=ctx.key, tokenizer=bundle.tokenizer,
        max_length=ctx.data.max_length, desc=f"{ctx.name} recovery", on_step=on_step)
    ctx.metrics.update(
        train_steps=result.steps, train_loss=result.final_loss,
        train_examples_per_s=result.examples_per_s, resumed_from_step=result.resumed_from)


def flops_example(bundle: ModelBundle) -> Any:
    """One example input: a full-length sequence for text models, an image otherwise."""
    config = getattr(bundle.model, "config", None)
    seq_len = min(FLOPS_SEQ_LEN, getattr(config, "max_position_embeddings", FLOPS_SEQ_LEN))
    return example_inputs(bundle.tokenizer, bundle.input_shape, 1, seq_len)

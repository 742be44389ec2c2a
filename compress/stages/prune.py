"""Stage `prune`: magnitude pruning of the current model, then optional recovery training.

Unstructured and global pruning zero weights (the model keeps its shapes: no speedup is
claimed); during recovery the zeros are re-applied after every optimizer step, and with
`gradual` the sparsity rises on a cubic schedule. Structured pruning makes the model
physically smaller and records its new shapes in `bundle.structure`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from torch import nn

from compress.algorithms.pruning import (
    Masks,
    apply_masks,
    count_macs,
    cubic_sparsity,
    layer_sparsity,
    overall_sparsity,
    prune_magnitude,
    prune_structured,
    select_layers,
)
from compress.errors import CompressError
from compress.models.bundle import ModelBundle, count_params
from compress.models.structure import merge_structure
from compress.recipe.kinds.prune import PruneConfig
from compress.stages.context import StageContext, State
from compress.train.loop import TrainSetup, total_steps
from export.graphs import example_inputs

FLOPS_SEQ_LEN = 128
REPRUNE_TIMES = 10  # how often gradual pruning raises the sparsity over the recovery steps


def prune(bundle: ModelBundle, cfg: PruneConfig, setup: TrainSetup | None = None,
          loss_fn: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Prune `bundle`'s model in place per `cfg`, recovering on `setup` (needed when
    `cfg.recovery` is set) with `loss_fn` (default: the training loop's cross-entropy on
    the labels); the figures. CompressError when nothing can be pruned."""
    model = bundle.model
    layers = select_layers(model, cfg.include, cfg.exclude)
    if not layers:
        raise CompressError(f"no layer matches include {cfg.include} minus exclude "
                            f"{cfg.exclude} (prunable: Linear and Conv2d modules)")
    if cfg.recovery is not None and setup is None:
        raise CompressError("recovery needs training examples (a TrainSetup)")
    example = flops_example(bundle)
    params_before, flops_before = count_params(model), count_macs(model, example)
    metrics: dict[str, Any] = {}
    try:
        if cfg.method == "structured":
            pruned, shapes = prune_structured(model, layers, cfg.target, cfg.amount)
            bundle.structure = merge_structure(bundle.structure, shapes)
            on_step = None
        else:
            pruned, on_step = prune_in_place(layers, cfg, setup)
    except ValueError as exc:
        raise CompressError(str(exc)) from None
    if cfg.recovery is not None:
        opts = cfg.recovery
        seed = opts.seed if opts.seed is not None else setup.seed
        recovery = replace(setup, seed=seed, desc=f"{setup.desc} recovery")
        extra = {} if loss_fn is None else {"loss_fn": loss_fn}
        metrics.update(recovery.run(model, opts, bundle.tokenizer, on_step=on_step,
                                    **extra).figures())
    if cfg.method != "structured":
        prune_magnitude(layers, cfg.amount, cfg.method)  # exact final sparsity, even if resumed
    return {**metrics,
            "sparsity_target": cfg.amount, "sparsity_layers": overall_sparsity(layers),
            "sparsity_per_layer": layer_sparsity(layers), "params_before": params_before,
            "params_after": count_params(model), "flops_before": flops_before,
            "flops_after": count_macs(model, example), "pruned_layers": len(pruned)}


def run(state: State, cfg: PruneConfig, ctx: StageContext) -> State:
    """Prune the current model, recover it if asked, save it, and record the figures."""
    ctx.metrics.update(prune(state.bundle, cfg, ctx.training() if cfg.recovery else None))
    ctx.save_model(state.bundle)
    return State(state.bundle)


def prune_in_place(layers: dict[str, nn.Module], cfg: PruneConfig, setup: TrainSetup | None
                   ) -> tuple[list[str], Callable[[int], None]]:
    """Prune now (or set up gradual pruning); return the layer names and the step callback."""
    if cfg.gradual:
        assert cfg.recovery is not None and setup is not None  # the validator guarantees it
        steps = total_steps(len(setup.examples), cfg.recovery)
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


def flops_example(bundle: ModelBundle) -> Any:
    """One example input: a full-length sequence for text models, an image otherwise."""
    config = getattr(bundle.model, "config", None)
    seq_len = min(FLOPS_SEQ_LEN, getattr(config, "max_position_embeddings", FLOPS_SEQ_LEN))
    return example_inputs(bundle.tokenizer, bundle.input_shape, 1, seq_len)

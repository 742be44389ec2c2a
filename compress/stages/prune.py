"""Stage `prune`: magnitude pruning of the current model, then optional recovery training.

Unstructured, global and semi-structured (n:m) pruning zero weights (the model keeps its
shapes: no speedup is claimed); during recovery the zeros are re-applied after every
optimizer step, and with `gradual` the sparsity rises on a cubic schedule. Structured
pruning makes the model physically smaller and records its new shapes in
`bundle.structure`. With `recovery_distill`, recovery learns the dense model's logits.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

from torch import nn

from compress.algorithms.distill import make_kd_loss_fn
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
from compress.algorithms.semi_structured import (
    broken_layers,
    input_norms,
    prune_n_m,
    split_by_group,
)
from compress.data.datasets import DataBundle, Examples, iterate
from compress.errors import CompressError
from compress.measure.evaluate import evaluate, logits_of
from compress.models.bundle import ModelBundle, count_params
from compress.models.structure import merge_structure
from compress.recipe.kinds.prune import PruneConfig
from compress.stages.context import StageContext, State
from compress.train.loop import TrainSetup, total_steps
from export.graphs import example_inputs

FLOPS_SEQ_LEN = 128
REPRUNE_TIMES = 10  # how often gradual pruning raises the sparsity over the recovery steps


def prune(bundle: ModelBundle, cfg: PruneConfig, setup: TrainSetup | None = None,
          loss_fn: Callable[..., Any] | None = None, *, calibration: Examples | None = None,
          max_length: int = 128, measure: Callable[[nn.Module], dict[str, Any]] | None = None
          ) -> dict[str, Any]:
    """Prune `bundle`'s model in place per `cfg`, recovering on `setup` (needed when
    `cfg.recovery` is set) with `loss_fn` (default: the training loop's cross-entropy on
    the labels); the figures. `calibration` (texts cut to `max_length` tokens, or images)
    feeds Wanda's input norms; `measure` (semi_structured) gives figures of the model
    pruned, before its recovery (recorded as `<figure>_pruned`). CompressError when
    nothing can be pruned."""
    if cfg.method == "semi_structured":
        return prune_semi_structured(bundle, cfg, setup, loss_fn, calibration=calibration,
                                     max_length=max_length, measure=measure)
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


def prune_semi_structured(bundle: ModelBundle, cfg: PruneConfig, setup: TrainSetup | None,
                          loss_fn: Callable[..., Any] | None, *, calibration: Examples | None,
                          max_length: int, measure: Callable[[nn.Module], dict[str, Any]] | None
                          ) -> dict[str, Any]:
    """n:m pruning of the chosen Linears (magnitude or Wanda scores), the masks re-applied
    after every recovery step and once more at the end; the figures."""
    model, (n, m) = bundle.model, cfg.n_m
    layers = select_layers(model, cfg.include, cfg.exclude)
    if cfg.recovery is not None and setup is None:
        raise CompressError("recovery needs training examples (a TrainSetup)")
    norms = None
    if cfg.scoring == "wanda":
        if calibration is None or len(calibration) == 0:
            raise CompressError("scoring wanda needs calibration examples (their input norms)")
        shown = calibration.head(cfg.calibration.samples)
        batches = (inputs for inputs, _ in iterate(shown, cfg.calibration.batch_size,
                                                   bundle.tokenizer, max_length))
        norms = input_norms(model, split_by_group(layers, m)[0], batches, logits_of)
    masks, pruned, skipped = prune_n_m(layers, n, m, norms)
    if not pruned:
        raise CompressError(f"pattern {cfg.pattern}: no chosen Linear has a multiple of {m} "
                            f"inputs (chosen: {', '.join(layers) or 'none'})")
    metrics: dict[str, Any] = {}
    if cfg.recovery is not None:
        if measure is not None:
            metrics.update({f"{k}_pruned": v for k, v in measure(model).items()})
        opts = cfg.recovery
        seed = opts.seed if opts.seed is not None else setup.seed
        recovery = replace(setup, seed=seed, desc=f"{setup.desc} recovery")
        extra = {} if loss_fn is None else {"loss_fn": loss_fn}
        metrics.update(recovery.run(model, opts, bundle.tokenizer,
                                    on_step=lambda step: apply_masks(pruned, masks),
                                    **extra).figures())
    apply_masks(pruned, masks)  # exact pattern, even if recovery resumed from a checkpoint
    return {**metrics, **n_m_figures(cfg, pruned, skipped)}


def n_m_figures(cfg: PruneConfig, pruned: dict[str, nn.Module], skipped: list[str]
                ) -> dict[str, Any]:
    """The pattern, the exact sparsity of the pruned Linears, how many were pruned and
    skipped (the skipped by name), and how many break the pattern (0 unless a bug)."""
    n, m = cfg.n_m
    return {"pattern": cfg.pattern, "scoring": cfg.scoring,
            "sparsity_target": round((m - n) / m, 6),
            "sparsity_layers": overall_sparsity(pruned),
            "sparsity_per_layer": layer_sparsity(pruned), "pruned_layers": len(pruned),
            "skipped_layers": len(skipped), "skipped_layer_names": skipped,
            "pattern_violations": len(broken_layers(pruned, n, m))}


def run(state: State, cfg: PruneConfig, ctx: StageContext) -> State:
    """Prune the current model, recover it if asked (from the labels, or from the dense
    model's logits), save it, and record the figures (accuracy right after pruning too,
    when it recovers)."""
    bundle, data = state.bundle, ctx.data
    loss_fn = None
    if cfg.recovery_distill:
        teacher = copy.deepcopy(bundle.model).eval()
        loss_fn = make_kd_loss_fn(teacher, cfg.temperature, cfg.alpha)
    measure = None
    if cfg.method == "semi_structured" and cfg.recovery is not None and "eval" in data.splits:
        batch = ctx.recipe.evaluation.batch_size if ctx.recipe is not None else 32
        measure = partial(eval_figures, data=data, batch_size=batch, tokenizer=bundle.tokenizer)
    ctx.metrics.update(prune(bundle, cfg, ctx.training() if cfg.recovery else None, loss_fn,
                             calibration=data.splits.get("calibration"),
                             max_length=data.max_length, measure=measure))
    ctx.save_model(bundle)
    return State(bundle)


def eval_figures(model: nn.Module, *, data: DataBundle, batch_size: int, tokenizer
                 ) -> dict[str, Any]:
    """Accuracy and macro-F1 of `model` on the eval split."""
    return evaluate(model, data.splits["eval"], batch_size, tokenizer, data.max_length,
                    data.num_labels)


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

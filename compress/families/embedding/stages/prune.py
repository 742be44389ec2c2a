"""Stage `prune` on an embedding model: the shared pruning (unstructured, global, or
structured: FFN neurons and attention heads removed, the model physically smaller), with its
`recovery` training the pruned model back towards the embeddings of the model that entered
the stage (a frozen copy), by the distillation loss of `distill.py`, not by labels."""

from __future__ import annotations

import copy

from compress.families.embedding.stages.distill import make_loss_fn
from compress.recipe.kinds.prune import PruneConfig
from compress.stages.context import StageContext, State
from compress.stages.prune import prune


def run(state: State, cfg: PruneConfig, ctx: StageContext) -> State:
    """Prune the encoder, recover it towards its unpruned self if asked, save it."""
    bundle = state.bundle
    loss_fn = None
    if cfg.recovery is not None:
        loss_fn = make_loss_fn(copy.deepcopy(bundle.model).eval())
    ctx.metrics.update(prune(bundle, cfg, ctx.training() if cfg.recovery else None,
                             loss_fn=loss_fn))
    ctx.save_model(bundle)
    return State(bundle)

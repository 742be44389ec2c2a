"""Stage `prune` on a reranker: the shared pruning (`compress.stages.prune`: unstructured,
global, semi-structured n:m, or structured: feed-forward neurons and attention heads removed,
the model physically smaller) of the cross-encoder's sequence classifier, named as the
classifier's modules (the default `exclude` leaves the embeddings, the pooler and the
one-label head alone). Its `recovery` trains the pruned model back towards the score logits
of the model that entered the stage (a frozen copy), by the distillation loss of
`distillation.py`, not by the relevance labels; with n:m and recovery, nDCG@10 and MRR@10
right after pruning are recorded too (`ndcg_at_10_pruned`)."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from compress.families.reranker.distillation import classifier_view, make_loss_fn
from compress.families.reranker.family import quality, score
from compress.models.bundle import ModelBundle
from compress.recipe.kinds.prune import PruneConfig
from compress.stages.context import StageContext, State
from compress.stages.prune import prune


def run(state: State, cfg: PruneConfig, ctx: StageContext) -> State:
    """Prune the cross-encoder, recover it towards its unpruned self if asked, save it."""
    bundle, data = state.bundle, ctx.data
    view = classifier_view(bundle)
    loss_fn = make_loss_fn(copy.deepcopy(view.model)) if cfg.recovery is not None else None

    def ranking(_: nn.Module) -> dict[str, Any]:
        return ranking_figures(bundle, ctx)

    ctx.metrics.update(prune(view, cfg, ctx.training() if cfg.recovery else None, loss_fn,
                             calibration=data.splits.get("calibration"),
                             max_length=data.max_length, measure=ranking))
    bundle.structure = view.structure
    ctx.save_model(bundle)
    return State(bundle)


def ranking_figures(bundle: ModelBundle, ctx: StageContext) -> dict[str, Any]:
    """nDCG@10 and MRR@10 of the reranker on the eval pairs."""
    examples = ctx.data.splits["eval"]
    scores = score(bundle.model, examples, ctx.recipe.evaluation.batch_size, bundle.tokenizer,
                   ctx.data.max_length)
    return quality(scores, None, examples)

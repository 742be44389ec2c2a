"""How a reranker learns from another cross-encoder (a distilled student from its teacher,
a pruned model from its unpruned self, a search shape from the entering model), and the
view of it that the shared students, training loop and pruning work on.

The loss is the mean squared difference between the student's one logit per pair and the
frozen teacher's, before the activation (sentence-transformers' own cross-encoder
distillation fits the teacher's logits by MSE the same way). Why this and not a KL over
each query's documents' scores:
- it is pointwise, so it trains on the shared loop's shuffled batches, which mix queries (a
  listwise KL needs each query's documents together in one batch);
- matching the logit keeps the order within every query *and* the scale across queries
  (a score threshold a user applies keeps its meaning; a per-query softmax is blind to a
  shift of one query's scores);
- before the activation: a Sigmoid saturates where the teacher is sure, and the squared
  difference of its outputs would give those pairs almost no gradient;
- a one-logit head has no distribution over labels: the classifier's KD loss (KL of
  softmaxes over the labels) is zero for it whatever the student does.
The relevance labels are not read, so a pair set without labels (or with a teacher better
than its labels) distils the same way.

The view: a reranker bundle's Hugging Face sequence classifier (`CrossEncoderScorer.classifier`)
as an "hf" bundle. Its module names are the classifier's (`bert.encoder.layer.0...`), so the
shared pruning's default `exclude` (embeddings, head, pooler) means what it says and the
shapes it records are the ones `folder.py` replays on a classifier; training it trains the
reranker's own module (the same object)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from compress.algorithms.distill import teacher_loss_fn
from compress.families.reranker.folder import KIND, CrossEncoderScorer
from compress.models.bundle import ModelBundle


def score_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over pairs of (student logit - teacher logit)^2 (the one-label head's logit)."""
    return F.mse_loss(student_logits.float()[:, 0], teacher_logits.float()[:, 0])


def make_loss_fn(teacher: nn.Module):
    """A `loss_fn(student, inputs, labels)` for the shared training loop: `teacher` a
    sequence classifier (a view's model), frozen; the labels ignored."""
    return teacher_loss_fn(teacher, lambda student, target, _: score_loss(student, target))


def classifier_view(bundle: ModelBundle) -> ModelBundle:
    """The reranker's sequence classifier as a Hugging Face bundle (the same module)."""
    return ModelBundle(bundle.model.classifier, "hf", ["score"], tokenizer=bundle.tokenizer,
                       structure=bundle.structure)


def as_reranker(view: ModelBundle, like: ModelBundle) -> ModelBundle:
    """A view's classifier (a student, a pruned copy) as a reranker scoring as `like` does:
    its activation and longest pair."""
    scorer: CrossEncoderScorer = like.model
    model = CrossEncoderScorer(view.model, type(scorer.activation).__name__, scorer.max_length)
    return ModelBundle(model.eval(), KIND, ["score"], tokenizer=view.tokenizer,
                       structure=view.structure)

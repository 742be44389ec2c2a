"""Stage `distill` on an embedding model: a student keeping some of the teacher's layers
(`student.layers`, evenly spaced, or `student.layer_indices`), trained on the train split's
text, labels unused, to give the frozen teacher's embeddings: the squared distance between
the two embeddings plus one minus their cosine, per text (sentence-transformers' model
distillation uses the first; the second keeps directions, which retrieval reads, for a
normalized model whose squared distance is small). Fidelity to the teacher is measured on
the eval split right after the drop and after training."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from compress.algorithms.distill import encoder_layers, evenly_spaced, student_from_layers
from compress.errors import CompressError
from compress.families.embedding.family import embed
from compress.families.embedding.measures import fidelity
from compress.measure.evaluate import logits_of
from compress.models.bundle import count_params
from compress.recipe.kinds.distill import DistillConfig
from compress.stages.context import StageContext, State


def embedding_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over texts of |s - t|^2 + (1 - cos(s, t))."""
    student, teacher = student.float(), teacher.float()
    distance = (student - teacher).pow(2).sum(-1)
    return (distance + 1 - F.cosine_similarity(student, teacher, dim=-1)).mean()


def make_loss_fn(teacher: nn.Module):
    """A `loss_fn(student, inputs, labels)` for the shared training loop (teacher frozen,
    labels ignored)."""
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    def loss_fn(student: nn.Module, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = logits_of(teacher, inputs)
        return embedding_loss(logits_of(student, inputs), target)

    return loss_fn


def run(state: State, cfg: DistillConfig, ctx: StageContext) -> State:
    """Drop layers, measure fidelity, train, measure again; save the student."""
    teacher = state.bundle
    if teacher.kind != "embedding":
        raise CompressError("distill needs a float sentence encoder as teacher; distil "
                            "before quantize")
    total = len(encoder_layers(teacher.model))
    spec = cfg.student
    keep = (evenly_spaced(spec.layers, total) if spec.layers is not None
            else list(spec.layer_indices or []))
    try:
        student = student_from_layers(teacher, keep)
    except ValueError as exc:
        raise CompressError(str(exc)) from None
    examples, batch = ctx.data.splits["eval"], ctx.recipe.evaluation.batch_size
    length = ctx.data.max_length
    target = embed(teacher.model, examples, batch, teacher.tokenizer, length)
    before = fidelity(embed(student.model, examples, batch, student.tokenizer, length), target)
    result = ctx.training().run(student.model, cfg, student.tokenizer,
                                loss_fn=make_loss_fn(teacher.model))
    student.model.eval()
    after = fidelity(embed(student.model, examples, batch, student.tokenizer, length), target)
    ctx.metrics.update(teacher_params=count_params(teacher.model), teacher_layers=total,
                       student_layers=len(keep), student_layer_indices=keep,
                       fidelity_to_teacher_before_training=before["fidelity"],
                       fidelity_to_teacher=after["fidelity"], **result.figures(),
                       **result.parallel_metrics())
    ctx.save_model(student)
    return State(student)

"""Stage `distill` on a reranker: the shared distillation (`compress.stages.distill`: a
student keeping some of the teacher's layers, `student.layers` evenly spaced or
`student.layer_indices`, or a fresh model of `student.hf_config`), trained on the train
split's pairs to give the frozen teacher's score logits (`distillation.py` says why that
loss). The student's closeness to the teacher is measured on the eval pairs after training:
Pearson's correlation of the scores over all pairs, and Kendall's tau per query, averaged
(near-ties of the teacher not counted)."""

from __future__ import annotations

from compress.errors import CompressError
from compress.families.reranker.distillation import as_reranker, classifier_view, make_loss_fn
from compress.families.reranker.family import score
from compress.families.reranker.folder import KIND
from compress.families.reranker.measures import agreement, pearson
from compress.families.reranker.pairs import groups_of
from compress.recipe.kinds.distill import DistillConfig
from compress.stages.context import StageContext, State
from compress.stages.distill import distill


def run(state: State, cfg: DistillConfig, ctx: StageContext) -> State:
    """Distil the entering cross-encoder into a student; measure it against the teacher;
    save it."""
    teacher = state.bundle
    if teacher is None or teacher.kind != KIND:
        raise CompressError("distill needs the float cross-encoder as its teacher; distil "
                            "before quantize")
    view = classifier_view(teacher)
    student_view, metrics = distill(view, cfg, ctx.training(),
                                    loss_fn=make_loss_fn(view.model))
    student = as_reranker(student_view, teacher)
    examples, batch = ctx.data.splits["eval"], ctx.recipe.evaluation.batch_size
    length = ctx.data.max_length
    want = score(teacher.model, examples, batch, teacher.tokenizer, length)
    got = score(student.model, examples, batch, student.tokenizer, length)
    close = agreement(got, want, groups_of(examples))
    ctx.metrics.update(metrics, distill_loss="mse of the score logit",
                       score_pearson_to_teacher=pearson(got, want),
                       kendall_tau_to_teacher=close.get("kendall_tau"))
    ctx.save_model(student)
    return State(student)

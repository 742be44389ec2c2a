"""Stage `distill`: train a smaller student on the frozen teacher's soft labels."""

from __future__ import annotations

from typing import Any

from compress.algorithms.distill import build_student, encoder_layers, make_kd_loss_fn
from compress.errors import CompressError
from compress.models.bundle import ModelBundle, count_params
from compress.recipe.kinds.distill import DistillConfig
from compress.stages.context import StageContext, State
from compress.train.loop import TrainSetup


def distill(teacher: ModelBundle, cfg: DistillConfig, setup: TrainSetup
            ) -> tuple[ModelBundle, dict[str, Any]]:
    """Build the student `cfg.student` describes, train it on `setup.examples` with the KD
    loss against the frozen `teacher`; the student and the figures (CompressError when the
    student cannot be built)."""
    try:
        student = build_student(teacher, cfg.student)
    except ValueError as exc:
        raise CompressError(str(exc)) from None
    result = setup.run(student.model, cfg, student.tokenizer,
                       loss_fn=make_kd_loss_fn(teacher.model, cfg.temperature, cfg.alpha))
    metrics = {"teacher_params": count_params(teacher.model), "temperature": cfg.temperature,
               "alpha": cfg.alpha, **result.figures(), **result.parallel_metrics()}
    if student.kind == "hf":
        metrics.update(teacher_layers=len(encoder_layers(teacher.model)),
                       student_layers=len(encoder_layers(student.model)))
    return student, metrics


def run(state: State, cfg: DistillConfig, ctx: StageContext) -> State:
    """Distil the entering model into a student, save it, and record both sizes."""
    student, metrics = distill(state.bundle, cfg, ctx.training())
    ctx.metrics.update(metrics)
    ctx.save_model(student)
    return State(student)

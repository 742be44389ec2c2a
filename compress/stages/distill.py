"""Stage `distill`: train a smaller student on the frozen teacher's soft labels."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from compress.algorithms.distill import build_student, encoder_layers, make_kd_loss_fn
from compress.algorithms.layerwise_distill import (
    attach_projections,
    detach_projections,
    layer_map,
    make_layerwise_loss_fn,
    matching_attention,
)
from compress.errors import CompressError
from compress.models.bundle import ModelBundle, count_params
from compress.recipe.kinds.distill import DistillConfig
from compress.stages.context import StageContext, State
from compress.train.loop import TrainSetup


def distill(teacher: ModelBundle, cfg: DistillConfig, setup: TrainSetup,
            loss_fn: Callable[..., Any] | None = None) -> tuple[ModelBundle, dict[str, Any]]:
    """Build the student `cfg.student` describes, train it on `setup.examples` with the KD
    loss against the frozen `teacher` (or a family's own `loss_fn(student, inputs, labels)`,
    which then replaces temperature, alpha and layerwise); the student and the figures
    (CompressError when the student cannot be built)."""
    try:
        student = build_student(teacher, cfg.student)
    except ValueError as exc:
        raise CompressError(str(exc)) from None
    own = loss_fn is not None
    if own:
        layerwise: dict[str, Any] = {}
    elif cfg.layerwise is None:
        loss_fn = make_kd_loss_fn(teacher.model, cfg.temperature, cfg.alpha)
        layerwise = {}
    else:
        if student.kind != "hf" or teacher.kind != "hf":
            raise CompressError("layerwise distillation needs a Hugging Face teacher and student")
        kept = (list(cfg.student.layer_indices) if cfg.student.layer_indices is not None else
                None)
        mapping = layer_map(len(encoder_layers(student.model)),
                            len(encoder_layers(teacher.model)), kept)
        attach_projections(student.model, teacher.model, len(mapping) + 1)
        loss_fn = make_layerwise_loss_fn(teacher.model, cfg, mapping)
        layerwise = {"layerwise_map": mapping, **{
            f"layerwise_{k}": v for k, v in cfg.layerwise.model_dump().items()}}
    with matching_attention(teacher.model, student.model,
                            not own and cfg.layerwise is not None
                            and cfg.layerwise.attention_weight > 0):
        result = setup.run(student.model, cfg, student.tokenizer, loss_fn=loss_fn)
    detach_projections(student.model)
    kd = {} if own else {"temperature": cfg.temperature, "alpha": cfg.alpha}
    metrics = {"teacher_params": count_params(teacher.model), **kd, **layerwise,
               **result.figures(), **result.parallel_metrics()}
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

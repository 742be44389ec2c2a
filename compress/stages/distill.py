"""Stage `distill`: train a smaller student on the frozen teacher's soft labels."""

from __future__ import annotations

from compress.distill import build_student, encoder_layers, make_kd_loss_fn
from compress.errors import StageError
from compress.models import count_params
from compress.stages.configs import DistillConfig
from compress.state import StageContext, State
from compress.train import train


def run(state: State, cfg: DistillConfig, ctx: StageContext) -> State:
    """Build the student, train it with the KD loss, save it, and record both sizes."""
    teacher = state.bundle
    try:
        student = build_student(teacher, cfg.student)
    except ValueError as exc:
        raise StageError(ctx.name, str(exc)) from None
    result = train(
        student.model, ctx.data.splits["train"], cfg, seed=ctx.seed,
        checkpoint_dir=ctx.checkpoint_dir, key=ctx.key, tokenizer=student.tokenizer,
        max_length=ctx.data.max_length, desc=ctx.name,
        loss_fn=make_kd_loss_fn(teacher.model, cfg.temperature, cfg.alpha))
    ctx.metrics.update(
        teacher_params=count_params(teacher.model), temperature=cfg.temperature,
        alpha=cfg.alpha, train_steps=result.steps, train_loss=result.final_loss,
        train_examples_per_s=result.examples_per_s, resumed_from_step=result.resumed_from)
    ctx.metrics.update(result.parallel_metrics())
    if student.kind == "hf":
        ctx.metrics.update(teacher_layers=len(encoder_layers(teacher.model)),
                           student_layers=len(encoder_layers(student.model)))
    ctx.save_model(student)
    return State(student)

"""Stage `distill` on a causal LM: a student keeping some of the teacher's decoder layers,
trained on the train split's text (packed into `data.max_length` blocks) against the frozen
teacher's next-token distributions. Perplexity is measured on the eval split for the teacher,
the student right after the drop, and the trained student. With `quantization_aware`, the
student's decoder Linears train on a weight scheme's grid and end on it
(`compress.families.causal_lm.algorithms.qat`): the int4 model a later `quantize` makes is the
one distilled."""

from __future__ import annotations

from compress.errors import CompressError
from compress.families.causal_lm.algorithms import qat
from compress.families.causal_lm.algorithms.distill import (
    decoder_layers,
    drop_layers,
    kept_layers,
    make_causal_lm_kd_loss_fn,
    packed_examples,
    recovery,
)
from compress.families.causal_lm.family import PPL_BATCH
from compress.families.causal_lm.model import perplexity
from compress.models.bundle import ModelBundle, count_params
from compress.recipe.kinds.distill import DistillConfig
from compress.stages.context import StageContext, State


def run(state: State, cfg: DistillConfig, ctx: StageContext) -> State:
    """Drop layers, measure, distil, measure again; save the student."""
    teacher = state.bundle
    if (teacher.causal_lm_facts or {}).get("scheme"):
        raise CompressError("distill needs a float teacher; distil before quantize")
    total = len(decoder_layers(teacher.model))
    try:
        keep = kept_layers(cfg.student, total)
        student = drop_layers(teacher.model, keep)
    except ValueError as exc:
        raise CompressError(str(exc)) from None
    texts, length = ctx.data.splits["eval"].texts, ctx.data.max_length
    ppl = {"teacher": perplexity(teacher.model, teacher.tokenizer, texts, length, PPL_BATCH),
           "dropped": perplexity(student.eval(), teacher.tokenizer, texts, length, PPL_BATCH)}
    ctx.log(f"distill: {total} -> {len(keep)} layers (kept {keep}); perplexity teacher "
            f"{ppl['teacher']['perplexity']:.2f}, right after the drop "
            f"{ppl['dropped']['perplexity']:.2f}")
    grid = cfg.quantization_aware
    if grid is not None:
        ctx.metrics["qat_linears"] = qat.prepare(student, grid.scheme, grid.group_size,
                                                 "float")
        ctx.metrics["qat_scheme"] = grid.scheme
    setup = ctx.training()
    setup.examples = packed_examples(teacher.tokenizer, setup.examples.texts, length)
    result = setup.run(student, cfg, None,
                       loss_fn=make_causal_lm_kd_loss_fn(teacher.model, cfg.temperature, cfg.alpha))
    qat.snap(student)
    after = perplexity(student.eval(), teacher.tokenizer, texts, length, PPL_BATCH)
    ctx.metrics.update({
        "teacher_layers": total, "student_layers": len(keep), "kept_layers": keep,
        "teacher_params": count_params(teacher.model), "train_blocks": len(setup.examples),
        "train_tokens_per_step": cfg.batch_size * cfg.grad_accum_steps * length,
        "perplexity_teacher": round(ppl["teacher"]["perplexity"], 4),
        "perplexity_dropped": round(ppl["dropped"]["perplexity"], 4),
        "temperature": cfg.temperature, "alpha": cfg.alpha, **result.figures(),
        **result.parallel_metrics(), **after,
    })
    ctx.metrics["recovery"] = recovery(ctx.metrics["perplexity_teacher"],
                                       ctx.metrics["perplexity_dropped"], after["perplexity"])
    facts = {**(teacher.causal_lm_facts or {}), "scheme": None, "distilled_from": total}
    bundle = ModelBundle(student, "causal-lm", [], tokenizer=teacher.tokenizer,
                         causal_lm_facts=facts)
    ctx.save_model(bundle)
    return State(bundle)

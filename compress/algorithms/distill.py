"""Knowledge distillation: the KL + CE loss and the ways to build a student from a teacher."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from compress.measure.evaluate import logits_of
from compress.models.bundle import ModelBundle
from compress.models.loading import build_factory


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
            labels: torch.Tensor | None, temperature: float, alpha: float) -> torch.Tensor:
    """alpha * CE(student, labels) + (1 - alpha) * T^2 * KL(softmax(t / T) || softmax(s / T)).

    The KL term is averaged over the batch; `alpha == 0` needs no labels.
    """
    t = temperature
    kl = F.kl_div(F.log_softmax(student_logits.float() / t, dim=-1),
                  F.log_softmax(teacher_logits.float() / t, dim=-1),
                  log_target=True, reduction="batchmean")
    loss = (1 - alpha) * t * t * kl
    if alpha > 0:
        loss = loss + alpha * F.cross_entropy(student_logits.float(), labels)
    return loss


def make_kd_loss_fn(teacher: nn.Module, temperature: float, alpha: float):
    """A `loss_fn(student, inputs, labels)` for the shared training loop (teacher frozen)."""
    return teacher_loss_fn(teacher, lambda student, target, labels: kd_loss(
        student, target, labels, temperature, alpha))


def teacher_loss_fn(teacher: nn.Module, loss: Callable[..., torch.Tensor]):
    """A `loss_fn(student, inputs, labels)` for the shared training loop giving
    `loss(student's outputs, teacher's outputs, labels)`, `teacher` frozen (eval mode, no
    gradients): what every distillation loss, whatever it compares, trains with."""
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    def loss_fn(student: nn.Module, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = logits_of(teacher, inputs)
        return loss(logits_of(student, inputs), target, labels)

    return loss_fn


def evenly_spaced(keep: int, total: int) -> list[int]:
    """`keep` layer indices spread over `total`, always keeping the first and the last."""
    if keep == 1:
        return [total - 1]
    return sorted({round(i * (total - 1) / (keep - 1)) for i in range(keep)})


def encoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer layer list of a Hugging Face encoder (BERT-style `encoder.layer`)."""
    base = getattr(model, "base_model", model)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no encoder.layer list to take layers from")
    return layers


def student_from_layers(teacher: ModelBundle, indices: list[int]) -> ModelBundle:
    """A copy of the teacher keeping only the transformer layers at `indices`."""
    total = len(encoder_layers(teacher.model))
    if max(indices) >= total or len(indices) > total:
        raise ValueError(f"the student keeps layers {indices} but the teacher has only {total} "
                         f"(indices 0..{total - 1})")
    model = copy.deepcopy(teacher.model)
    layers = encoder_layers(model)
    kept = nn.ModuleList([layers[i] for i in indices])
    getattr(model, "base_model", model).encoder.layer = kept
    model.config.num_hidden_layers = len(indices)
    for p in model.parameters():
        p.requires_grad_(True)
    return ModelBundle(model, teacher.kind, teacher.label_names, tokenizer=teacher.tokenizer)


def student_from_hf_config(teacher: ModelBundle, overrides: dict[str, Any]) -> ModelBundle:
    """A freshly initialised model of the teacher's architecture with config `overrides`."""
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(teacher.model.config)
    unknown = [k for k in overrides if not hasattr(config, k)]
    if unknown:
        raise ValueError(f"student.hf_config: unknown config keys {unknown}")
    for key, value in overrides.items():
        setattr(config, key, value)
    model = AutoModelForSequenceClassification.from_config(config)
    return ModelBundle(model, "hf", teacher.label_names, tokenizer=teacher.tokenizer)


def build_student(teacher: ModelBundle, spec) -> ModelBundle:
    """The student that `spec` (a StudentSpec) describes."""
    if spec.factory:
        model = build_factory(spec.factory, spec.kwargs)
        return ModelBundle(model.train(), "factory", teacher.label_names,
                           tokenizer=teacher.tokenizer, factory=spec.factory,
                           kwargs=dict(spec.kwargs), input_shape=list(teacher.input_shape))
    if teacher.kind != "hf":
        raise ValueError("layers, layer_indices and hf_config students need a Hugging Face "
                         "teacher; use student.factory for other models")
    if teacher.structure is not None:
        raise ValueError("the teacher was structurally pruned; distill before pruning")
    if spec.hf_config is not None:
        return student_from_hf_config(teacher, spec.hf_config)
    total = len(encoder_layers(teacher.model))
    if spec.layers is not None:
        if spec.layers > total:
            raise ValueError(f"the student keeps {spec.layers} layers but the teacher has "
                             f"only {total}")
        return student_from_layers(teacher, evenly_spaced(spec.layers, total))
    return student_from_layers(teacher, list(spec.layer_indices))

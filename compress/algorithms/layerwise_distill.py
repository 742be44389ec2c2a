"""Layer-wise distillation (TinyBERT, MiniLM): beside the logits' KL + CE loss, the student's
hidden states and attention distributions are pulled toward those of the teacher layers
each student layer maps to.

A student that copies teacher layers maps each to the layer it copied; any other student
maps its layers onto evenly spaced teacher layers. Hidden states are matched after the
embeddings and after every mapped layer (mean squared error or cosine distance over real
tokens); when the widths differ, a learned projection per matched pair maps the student's
width to the teacher's (trained with the student, dropped before it is saved). Attention is
matched by the KL divergence of the teacher's distributions from the student's, per head
(averaged over heads when the counts differ), which needs the eager attention kernel while
training: it is switched on, with the student's attention dropout off, only for the run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from compress.algorithms.distill import evenly_spaced, kd_loss

PROJECTIONS = "layerwise_projections"  # the student's submodule while it trains


def layer_map(student_layers: int, teacher_layers: int, kept: list[int] | None) -> list[int]:
    """The teacher layer each student layer learns from."""
    return list(kept) if kept is not None else evenly_spaced(student_layers, teacher_layers)


def hidden_width(model: nn.Module) -> int:
    return int(model.config.hidden_size)


def attach_projections(student: nn.Module, teacher: nn.Module, pairs: int) -> None:
    """Give the student one learned width projection per matched pair when its hidden size
    differs from the teacher's (nothing when they are equal)."""
    width, target = hidden_width(student), hidden_width(teacher)
    if width != target:
        student.add_module(PROJECTIONS, nn.ModuleList(
            nn.Linear(width, target, bias=False) for _ in range(pairs)))


def detach_projections(student: nn.Module) -> None:
    """Remove the projections (they are a training aid, not part of the model)."""
    if hasattr(student, PROJECTIONS):
        delattr(student, PROJECTIONS)


def hidden_distance(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                    kind: str) -> torch.Tensor:
    """Mean squared error or cosine distance between B x L x D hidden states, averaged over
    the real tokens of `mask` (B x L)."""
    if kind == "cosine":
        per_token = 1 - F.cosine_similarity(student.float(), teacher.float(), dim=-1)
    else:
        per_token = (student.float() - teacher.float()).pow(2).mean(-1)
    weights = mask.float()
    return (per_token * weights).sum() / weights.sum().clamp_min(1)


def attention_divergence(student: torch.Tensor, teacher: torch.Tensor,
                         mask: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) of B x H x L x L attention distributions over the keys, averaged
    over heads and real query tokens (heads averaged first when the counts differ)."""
    if student.shape[1] != teacher.shape[1]:
        student, teacher = student.mean(1, keepdim=True), teacher.mean(1, keepdim=True)
    teacher, student = teacher.float(), student.float()
    kl = (teacher * (teacher.clamp_min(1e-9).log() - student.clamp_min(1e-9).log())).sum(-1)
    rows = mask[:, None, :].float().expand_as(kl)
    return (kl * rows).sum() / rows.sum().clamp_min(1)


def make_layerwise_loss_fn(teacher: nn.Module, cfg: Any, mapping: list[int]):
    """A `loss_fn(student, inputs, labels)`: the KD loss of `cfg` (temperature, alpha) plus
    `cfg.layerwise`'s hidden-state and attention terms over `mapping` (teacher frozen)."""
    spec = cfg.layerwise
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    attention = spec.attention_weight > 0
    pairs = [(0, 0)] + [(j + 1, t + 1) for j, t in enumerate(mapping)]  # embeddings, layers

    def loss_fn(student: nn.Module, inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            want = teacher(**inputs, output_hidden_states=True, output_attentions=attention)
        got = student(**inputs, output_hidden_states=True, output_attentions=attention)
        loss = kd_loss(got.logits, want.logits, labels, cfg.temperature, cfg.alpha)
        mask = inputs["attention_mask"]
        if spec.hidden_weight > 0:
            projections = getattr(getattr(student, "module", student), PROJECTIONS, None)
            hidden = sum(hidden_distance(
                got.hidden_states[s] if projections is None else projections[k](
                    got.hidden_states[s]), want.hidden_states[t], mask, spec.hidden_loss)
                for k, (s, t) in enumerate(pairs))
            loss = loss + spec.hidden_weight * hidden / len(pairs)
        if attention:
            divergence = sum(attention_divergence(got.attentions[s], want.attentions[t], mask)
                             for s, t in enumerate(mapping))
            loss = loss + spec.attention_weight * divergence / len(mapping)
        return loss

    return loss_fn


@contextmanager
def matching_attention(teacher: nn.Module, student: nn.Module, enabled: bool) -> Iterator[None]:
    """With `enabled`, both models run the eager attention kernel (the only one that returns
    its distributions) and the student's attention dropout is off, for the block only."""
    if not enabled:
        yield
        return
    own = [(m, m.config._attn_implementation) for m in (teacher, student)]
    dropouts = [(module, module.p) for name, module in student.named_modules()
                if isinstance(module, nn.Dropout) and name.endswith("attention.self.dropout")]
    for model, _ in own:
        model.set_attn_implementation("eager")
    for module, _ in dropouts:
        module.p = 0.0
    try:
        yield
    finally:
        for model, implementation in own:
            model.set_attn_implementation(implementation)
        for module, p in dropouts:
            module.p = p

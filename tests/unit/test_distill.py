"""Distillation: the KD loss by hand, student construction, and a stage run on a tiny BERT."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from compress.algorithms.distill import build_student, encoder_layers, evenly_spaced, kd_loss
from compress.models.loading import load_model
from compress.recipe.kinds.distill import StudentSpec
from compress.recipe.sources import resolve_model


def test_kd_loss_equals_the_hand_computed_value() -> None:
    student = torch.tensor([[1.0, 2.0, 0.5]])
    teacher = torch.tensor([[2.0, 0.0, 1.0]])
    labels = torch.tensor([1])
    t, alpha = 2.0, 0.3
    p_teacher = [math.exp(v / t) for v in (2.0, 0.0, 1.0)]
    p_teacher = [v / sum(p_teacher) for v in p_teacher]
    p_student = [math.exp(v / t) for v in (1.0, 2.0, 0.5)]
    p_student = [v / sum(p_student) for v in p_student]
    kl = sum(pt * math.log(pt / ps) for pt, ps in zip(p_teacher, p_student, strict=True))
    ce = -math.log(math.exp(2.0) / sum(math.exp(v) for v in (1.0, 2.0, 0.5)))
    expected = alpha * ce + (1 - alpha) * t * t * kl
    assert kd_loss(student, teacher, labels, t, alpha).item() == pytest.approx(expected, 1e-6)
    assert kd_loss(teacher, teacher, None, t, 0.0).item() == pytest.approx(0.0, abs=1e-7)


def test_evenly_spaced_layers() -> None:
    assert evenly_spaced(3, 6) == [0, 2, 5]
    assert evenly_spaced(2, 6) == [0, 5]
    assert evenly_spaced(1, 6) == [5]
    assert evenly_spaced(6, 6) == list(range(6))


def test_layer_student_copies_the_teachers_layers(tiny_bert: Path) -> None:
    teacher = load_model(resolve_model(str(tiny_bert)), ["neg", "pos"], [])
    student = build_student(teacher, StudentSpec(layer_indices=[1]))
    assert len(encoder_layers(student.model)) == 1 and student.model.config.num_hidden_layers == 1
    kept = encoder_layers(student.model)[0].output.dense.weight
    assert torch.equal(kept, encoder_layers(teacher.model)[1].output.dense.weight)
    assert kept.data_ptr() != encoder_layers(teacher.model)[1].output.dense.weight.data_ptr()
    assert len(encoder_layers(teacher.model)) == 2  # the teacher is untouched


def test_student_with_more_layers_than_the_teacher_is_refused(tiny_bert: Path) -> None:
    teacher = load_model(resolve_model(str(tiny_bert)), ["neg", "pos"], [])
    with pytest.raises(ValueError, match="keeps 3 layers but the teacher has only 2"):
        build_student(teacher, StudentSpec(layers=3))
    with pytest.raises(ValueError, match="teacher has only 2"):
        build_student(teacher, StudentSpec(layer_indices=[0, 4]))


def test_hf_config_student_is_fresh_and_smaller(tiny_bert: Path) -> None:
    teacher = load_model(resolve_model(str(tiny_bert)), ["neg", "pos"], [])
    student = build_student(teacher, StudentSpec(hf_config={"num_hidden_layers": 1}))
    assert len(encoder_layers(student.model)) == 1
    with pytest.raises(ValueError, match="unknown config keys"):
        build_student(teacher, StudentSpec(hf_config={"num_layerz": 1}))


def test_student_spec_needs_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StudentSpec(layers=2, factory="compress.models.zoo:mlp")
    with pytest.raises(ValueError, match="exactly one of"):
        StudentSpec()



"""Layer-wise distillation on a tiny BERT: the hidden-state and attention terms by hand, the
layer map, width projections that train and are dropped, and the kernels given back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from builders import SENTENCES

from compress.algorithms.distill import build_student, kd_loss
from compress.algorithms.layerwise_distill import (
    PROJECTIONS,
    attention_divergence,
    hidden_distance,
    layer_map,
    make_layerwise_loss_fn,
)
from compress.data.datasets import Examples
from compress.models.loading import load_model
from compress.recipe.kinds.distill import DistillConfig, StudentSpec
from compress.recipe.sources import resolve_model
from compress.stages.distill import distill
from compress.train.loop import TrainSetup


def _teacher(tiny_bert: Path):
    return load_model(resolve_model(str(tiny_bert)), ["neg", "pos"], [])


def _inputs(tokenizer) -> dict:
    return dict(tokenizer(SENTENCES[:4], padding=True, return_tensors="pt"))


def test_the_distances_by_hand() -> None:
    a = torch.tensor([[[1.0, 0.0], [3.0, 4.0]]])
    b = torch.tensor([[[0.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[1, 0]])  # the second token is padding: it does not count
    assert hidden_distance(a, b, mask, "mse").item() == pytest.approx(0.5)
    assert hidden_distance(a, 2 * a, mask, "cosine").item() == pytest.approx(0.0, abs=1e-6)
    teacher = torch.tensor([[[[0.5, 0.5], [1.0, 0.0]]]])
    student = torch.tensor([[[[0.25, 0.75], [0.0, 1.0]]]])
    expected = 0.5 * torch.log(torch.tensor(2.0)) + 0.5 * torch.log(torch.tensor(2 / 3))
    assert attention_divergence(student, teacher, mask).item() == pytest.approx(
        expected.item(), 1e-5)
    assert attention_divergence(teacher, teacher, torch.ones(1, 2)).item() == pytest.approx(0)


def test_the_layer_map() -> None:
    assert layer_map(3, 6, None) == [0, 2, 5]
    assert layer_map(2, 6, [1, 4]) == [1, 4]


def test_a_prefix_student_matches_its_teachers_layers_exactly(tiny_bert: Path) -> None:
    """Copying the teacher's first layer: the embeddings and that layer's output are the
    teacher's, so the layer-wise terms add nothing to the KD loss; copying the second
    layer instead (fed the embeddings, not layer 0's output) makes them positive."""
    teacher = _teacher(tiny_bert)
    inputs = _inputs(teacher.tokenizer)
    cfg = DistillConfig(student=StudentSpec(layer_indices=[0]),
                        layerwise={"hidden_weight": 1.0, "attention_weight": 1.0})
    with torch.no_grad():
        want = teacher.model(**inputs).logits
        for kept, positive in (([0], False), ([1], True)):
            student = build_student(teacher, StudentSpec(layer_indices=kept)).model.eval()
            student.set_attn_implementation("eager")
            teacher.model.set_attn_implementation("eager")
            logits_only = kd_loss(student(**inputs).logits, want, None, cfg.temperature, 0.0)
            alpha_free = cfg.model_copy(update={"alpha": 0.0})
            loss = make_layerwise_loss_fn(teacher.model, alpha_free, kept)(student, inputs, None)
            extra = (loss - logits_only).item()
            assert (extra > 1e-6) if positive else abs(extra) < 1e-7, (kept, extra)


def _trained(teacher, student: dict, layerwise: dict | None):
    texts = SENTENCES * 8
    examples = Examples(labels=[i % 2 for i in range(len(texts))], texts=texts)
    cfg = DistillConfig(student=StudentSpec(**student), max_steps=30, batch_size=8,
                        learning_rate=3e-3, warmup_ratio=0.0, layerwise=layerwise)
    torch.manual_seed(0)
    return distill(teacher, cfg, TrainSetup(examples, max_length=32))


def test_layerwise_training_pulls_the_mapped_hidden_states_closer(tiny_bert: Path) -> None:
    teacher = _teacher(tiny_bert)
    inputs = _inputs(teacher.tokenizer)
    mask = inputs["attention_mask"]

    def gap(model) -> float:  # the hidden term over the pairs (embeddings, layer 1)
        with torch.no_grad():
            got = model.eval()(**inputs, output_hidden_states=True).hidden_states
            want = teacher.model(**inputs, output_hidden_states=True).hidden_states
        return sum(hidden_distance(got[s], want[t], mask, "mse").item()
                   for s, t in ((0, 0), (1, 2)))

    logits_only, plain = _trained(teacher, {"layers": 1}, None)
    layerwise, metrics = _trained(teacher, {"layers": 1}, {"hidden_weight": 10.0})
    assert "layerwise_map" not in plain and metrics["layerwise_map"] == [1]
    assert metrics["layerwise_hidden_weight"] == 10.0 and metrics["train_steps"] == 30
    assert gap(layerwise.model) < 0.8 * gap(logits_only.model)


def test_a_narrower_student_trains_with_projections_that_are_dropped(tiny_bert: Path) -> None:
    """A student of another width trains with a projection per matched pair, gone
    afterwards; the eager kernel and the attention dropout are given back."""
    teacher = _teacher(tiny_bert)
    student = {"hf_config": {"num_hidden_layers": 1, "hidden_size": 16,
                             "intermediate_size": 32}}
    trained, metrics = _trained(teacher, student, {"hidden_weight": 1.0,
                                                   "attention_weight": 0.5})
    assert metrics["layerwise_map"] == [1] and metrics["train_steps"] == 30
    assert not hasattr(trained.model, PROJECTIONS)
    assert not any(PROJECTIONS in key for key in trained.model.state_dict())
    assert trained.model.config._attn_implementation == "sdpa"
    assert teacher.model.config._attn_implementation == "sdpa"
    dropouts = [m.p for n, m in trained.model.named_modules()
                if n.endswith("attention.self.dropout")]
    assert dropouts and all(p == trained.model.config.attention_probs_dropout_prob
                            for p in dropouts)

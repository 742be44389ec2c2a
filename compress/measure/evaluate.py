"""Accuracy and macro-F1 of a model on one split."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compress.data.datasets import Examples, iterate


def logits_of(model: nn.Module, inputs: Any) -> torch.Tensor:
    """Logits of a Hugging Face classifier (dict inputs) or a plain module (tensor inputs)."""
    out = model(**inputs) if isinstance(inputs, dict) else model(inputs)
    if isinstance(out, torch.Tensor):
        return out
    return out["logits"] if isinstance(out, dict) else out.logits


@torch.inference_mode()
def predict(model: nn.Module, examples: Examples, batch_size: int, tokenizer,
            max_length: int) -> torch.Tensor:
    """Predicted label ids for every example, in order."""
    was_training = model.training
    model.eval()
    preds = [logits_of(model, inputs).argmax(-1)
             for inputs, _ in iterate(examples, batch_size, tokenizer, max_length)]
    model.train(was_training)
    return torch.cat(preds) if preds else torch.empty(0, dtype=torch.long)


def classification_metrics(preds: torch.Tensor, labels: list[int], num_labels: int) -> dict:
    """Accuracy and macro-F1 (the mean over all `num_labels` classes)."""
    y = torch.tensor(labels, dtype=torch.long)
    accuracy = float((preds == y).float().mean()) if len(y) else 0.0
    return {"accuracy": round(accuracy, 6), "macro_f1": round(macro_f1(preds, y, num_labels), 6)}


def macro_f1(preds: torch.Tensor, labels: torch.Tensor, num_labels: int) -> float:
    """scikit-learn's `f1_score(labels, preds, average="macro", labels=range(num_labels),
    zero_division=0)`: each class's 2 tp / (2 tp + fp + fn), 0 for a class in neither, and
    their mean. Here, not scikit-learn's: importing `sklearn.metrics` cost every process that
    evaluated 1-2 s of CPU (scipy and more), for a dozen operations."""
    if num_labels == 0:
        return 0.0
    classes = torch.arange(num_labels)[:, None]
    predicted, actual = preds.long()[None, :] == classes, labels[None, :] == classes
    tp = (predicted & actual).sum(1).double()
    wrong = (predicted ^ actual).sum(1).double()  # fp + fn
    f1 = torch.where(2 * tp + wrong > 0, 2 * tp / (2 * tp + wrong).clamp(min=1), 0.0)
    return float(f1.mean())


def evaluate(model: nn.Module, examples: Examples, batch_size: int, tokenizer,
             max_length: int, num_labels: int) -> dict:
    """Accuracy and macro-F1 on `examples`."""
    preds = predict(model, examples, batch_size, tokenizer, max_length)
    return classification_metrics(preds, examples.labels, num_labels)

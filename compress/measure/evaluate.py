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
    """Accuracy and macro-F1 (mean over the classes of the labels or predictions)."""
    from sklearn.metrics import f1_score

    y = torch.tensor(labels)
    accuracy = float((preds == y).float().mean()) if len(y) else 0.0
    f1 = f1_score(y.numpy(), preds.numpy(), average="macro", labels=list(range(num_labels)),
                  zero_division=0)
    return {"accuracy": round(accuracy, 6), "macro_f1": round(float(f1), 6)}


def evaluate(model: nn.Module, examples: Examples, batch_size: int, tokenizer,
             max_length: int, num_labels: int) -> dict:
    """Accuracy and macro-F1 on `examples`."""
    preds = predict(model, examples, batch_size, tokenizer, max_length)
    return classification_metrics(preds, examples.labels, num_labels)

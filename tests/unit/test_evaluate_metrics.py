"""compress.measure.evaluate's macro-F1 is scikit-learn's, without importing it."""

from __future__ import annotations

import pytest
import torch
from sklearn.metrics import f1_score

from compress.measure.evaluate import classification_metrics, macro_f1


@pytest.mark.parametrize("classes", [1, 2, 3, 10])
@pytest.mark.parametrize("seed", range(5))
def test_macro_f1_is_sklearns_with_every_class_counted(classes: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    n = int(torch.randint(0, 60, (1,), generator=generator))
    labels = torch.randint(0, classes, (n,), generator=generator)
    # some predictions right, some classes never predicted or never present
    preds = torch.where(torch.rand(n, generator=generator) < 0.6, labels,
                        torch.randint(0, max(1, classes - 1), (n,), generator=generator))
    want = f1_score(labels.numpy(), preds.numpy(), average="macro",
                    labels=list(range(classes)), zero_division=0)
    assert macro_f1(preds, labels, classes) == pytest.approx(want, abs=1e-12)


def test_a_class_in_neither_labels_nor_predictions_counts_as_0() -> None:
    preds, labels = torch.tensor([0, 1, 1]), [0, 1, 0]
    # classes 0 and 1: F1 2/3 each; class 2 in neither: 0
    assert classification_metrics(preds, labels, 3) == {"accuracy": 0.666667,
                                                       "macro_f1": round(4 / 9, 6)}
    assert classification_metrics(torch.empty(0, dtype=torch.long), [], 2) == {
        "accuracy": 0.0, "macro_f1": 0.0}

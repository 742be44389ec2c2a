"""Parity of an exported model with the model it came from, on real eval batches."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compress.data.datasets import Examples, iterate
from compress.errors import ParityError
from compress.measure.evaluate import classification_metrics, logits_of

LOSSLESS_TOLERANCE = {"torchscript": 1e-5, "onnx": 1e-4, "aoti": 1e-4, "tensorrt": 1e-3,
                      "executorch": 1e-4}
LOSSLESS_AGREEMENT = 0.995
QUANTIZING_AGREEMENT = 0.90  # int8 flips borderline examples both ways; accuracy decides
QUANTIZING_MAX_DROP = 1.5  # points of accuracy an export that quantizes may lose


@torch.inference_mode()
def compare(reference: nn.Module, exported: nn.Module, examples: Examples, batch_size: int,
            tokenizer, max_length: int, num_labels: int) -> dict[str, Any]:
    """Max and mean absolute logit difference, argmax agreement, and the exported model's
    accuracy and macro-F1, over `examples` in batches padded to their longest item."""
    reference.eval()
    exported.eval()
    worst, total_diff, agree, preds, wanted = 0.0, 0.0, 0, [], []
    for inputs, _ in iterate(examples, batch_size, tokenizer, max_length):
        want = logits_of(reference, inputs).float()
        got = logits_of(exported, inputs).float()
        diff = (want - got).abs()
        worst = max(worst, float(diff.max()))
        total_diff += float(diff.mean()) * len(got)
        agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        preds.append(got.argmax(-1))
        wanted.append(want.argmax(-1))
    n = len(examples)
    figures = {"parity_samples": n, "parity_max_abs_diff": worst,
               "parity_mean_abs_diff": total_diff / n if n else 0.0,
               "parity_argmax_agreement": round(agree / n, 6) if n else 1.0}
    figures.update(classification_metrics(torch.cat(preds), examples.labels, num_labels))
    figures["source_accuracy"] = classification_metrics(
        torch.cat(wanted), examples.labels, num_labels)["accuracy"]
    return figures


def check(figures: dict[str, Any], tolerance: float | None, min_agreement: float,
          max_drop: float | None, where: str) -> None:
    """Raise a one-line ParityError with the figures when parity is out of bounds."""
    problems = []
    if tolerance is not None and figures["parity_max_abs_diff"] > tolerance:
        problems.append(f"max |logit difference| {figures['parity_max_abs_diff']:.3g} > "
                        f"tolerance {tolerance:g}")
    if figures["parity_argmax_agreement"] < min_agreement:
        problems.append(f"argmax agreement {figures['parity_argmax_agreement']:.4f} < "
                        f"min_agreement {min_agreement:g}")
    drop = 100 * (figures["source_accuracy"] - figures["accuracy"])
    if max_drop is not None and drop > max_drop:
        problems.append(f"accuracy {100 * figures['accuracy']:.2f}% is {drop:.2f} points "
                        f"below the source's > max_accuracy_drop {max_drop:g}")
    if problems:
        raise ParityError(f"parity check failed on {figures['parity_samples']} eval "
                         f"examples: {'; '.join(problems)} (file kept in {where}; raise "
                         f"tolerance, min_agreement or max_accuracy_drop to accept it)")

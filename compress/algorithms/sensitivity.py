"""Per-layer int8 sensitivity: which layers int8 hurts most, one layer at a time.

Each Linear (and Conv2d) layer alone is run in emulated int8, as the x86 quantizers do it
(weights symmetric per output channel, inputs affine per tensor over the range observed
on calibration examples), with the rest of the model in float. The layer's score is how
far the model's output moves from the float model's on the same examples (a `Divergence`:
the KL divergence of a classifier's output distribution, `KL`, or the cosine distance of an
embedding, `COSINE`). The ranking does not depend on a backend: the search keeps the top layers in
float, one more at a time, in whichever backend falls short.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from compress.measure.evaluate import logits_of

QUANTIZABLE = (nn.Linear, nn.Conv2d)


@dataclass(frozen=True)
class Divergence:
    """How far one output is from the float model's: `prepare` maps the model's output
    (examples x features) to what is compared, `total` sums the distance over examples."""

    name: str
    what: str  # for sensitivity.json's method line
    prepare: Callable[[torch.Tensor], torch.Tensor]
    total: Callable[[torch.Tensor, torch.Tensor], float]  # (got, want) -> sum over examples


KL = Divergence(
    "KL", "KL divergence of the output distribution from the float model's",
    lambda out: F.log_softmax(out.float(), -1),
    lambda got, want: float(F.kl_div(got, want, log_target=True, reduction="sum")))
COSINE = Divergence(
    "1 - cosine", "one minus the cosine between the output and the float model's",
    lambda out: out.float(),
    lambda got, want: float((1 - F.cosine_similarity(got, want, dim=-1)).sum()))


def quantizable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module of every layer an int8 quantizer turns into an int8 kernel."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QUANTIZABLE)}


def fake_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` through symmetric int8 with one scale per output channel."""
    flat = weight.detach().reshape(weight.shape[0], -1)
    scale = (flat.abs().amax(dim=1) / 127).clamp(min=1e-12).float()
    zero = torch.zeros_like(scale, dtype=torch.int32)
    return torch.fake_quantize_per_channel_affine(weight.detach().float(), scale, zero, 0,
                                                  -128, 127).to(weight.dtype)


def fake_uint8_input(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """`x` through affine uint8 over [low, high] (the range always holds 0)."""
    low, high = min(low, 0.0), max(high, 0.0)
    scale = max((high - low) / 255, 1e-12)
    zero = int(min(255, max(0, round(-low / scale))))
    return torch.fake_quantize_per_tensor_affine(x, scale, zero, 0, 255)


@torch.inference_mode()
def rank_layers(model: nn.Module, batches: list[Any],
                progress: Callable[[int, int], None] | None = None,
                divergence: Divergence = KL) -> list[dict[str, Any]]:
    """Every quantizable layer of `model` with its `score` (the divergence's mean per
    example, the float model's output as the reference) when it alone is in int8, most
    sensitive first. `batches` are model inputs (tokenizer dicts or tensors)."""
    model.eval()
    layers = quantizable_layers(model)
    ranges: dict[str, list[float]] = {name: [float("inf"), float("-inf")] for name in layers}

    def observe(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            seen = ranges[name]
            seen[0] = min(seen[0], float(args[0].min()))
            seen[1] = max(seen[1], float(args[0].max()))
        return hook

    handles = [m.register_forward_pre_hook(observe(n)) for n, m in layers.items()]
    try:
        reference = [divergence.prepare(logits_of(model, b)) for b in batches]
    finally:
        for handle in handles:
            handle.remove()
    ranking = []
    for done, (name, layer) in enumerate(layers.items(), 1):
        ranking.append({"layer": name, "score": _divergence_with_int8(
            model, layer, ranges[name], batches, reference, divergence)})
        if progress is not None:
            progress(done, len(layers))
    ranking.sort(key=lambda r: r["score"], reverse=True)
    return ranking


def _divergence_with_int8(model: nn.Module, layer: nn.Module, seen: list[float],
                          batches: list[Any], reference: list[torch.Tensor],
                          divergence: Divergence) -> float:
    """The mean divergence of the model with `layer` in int8 from the float model over
    the examples of `batches`."""
    original = layer.weight.data
    layer.weight.data = fake_int8_weight(original)
    handle = layer.register_forward_pre_hook(
        lambda m, args: (fake_uint8_input(args[0], *seen), *args[1:]))
    total, count = 0.0, 0
    try:
        for inputs, want in zip(batches, reference, strict=True):
            total += divergence.total(divergence.prepare(logits_of(model, inputs)), want)
            count += len(want)
    finally:
        handle.remove()
        layer.weight.data = original
    return total / max(count, 1)


def fallback_layers(ranking: list[str], good: Callable[[list[str]], bool | None],
                    limit: int) -> list[str] | None:
    """The fewest top layers of `ranking` (1, 2, ... up to `limit`) kept in float for which
    `good(layers)` is True; None when no count is, or when `good` says None (stop: the
    trial failed, is no faster than float, or the budget is spent)."""
    for count in range(1, min(limit, len(ranking)) + 1):
        verdict = good(ranking[:count])
        if verdict:
            return ranking[:count]
        if verdict is None:
            return None
    return None


def sensitivity_report(ranking: list[dict[str, Any]], samples: int, began: float,
                       divergence: Divergence = KL) -> dict[str, Any]:
    """What `sensitivity.json` holds: the method, the examples and the ranking."""
    return {"method": "one layer at a time in emulated int8 (weights symmetric per output "
                      "channel, inputs affine uint8 over the calibration range); score: "
                      f"{divergence.what}", "divergence": divergence.name,
            "samples": samples, "seconds": round(time.perf_counter() - began, 2),
            "ranking": [{**r, "score": float(f"{r['score']:.6g}")} for r in ranking]}

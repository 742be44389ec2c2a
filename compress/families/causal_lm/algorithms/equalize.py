"""Activation-aware scaling of a causal LM's Linears before low-bit weight quantization
(the AWQ idea: Lin et al., 2023), folded into the float model so nothing changes at run time.

A Linear's output error from weight rounding is the rounding error weighted by its input:
channels that carry large activations matter most. Scaling a Linear's input channel j by
`s_j` (its weight column multiplied by `s_j`) while dividing whatever produces that channel
by `s_j` leaves the float model's function unchanged, and gives the salient columns more of
the quantization grid. Per decoder layer, three such pairs exist in a Llama-style block:

- `input_layernorm` -> `q_proj`, `k_proj`, `v_proj` (the norm's weight divided by s);
- `post_attention_layernorm` -> `gate_proj`, `up_proj`;
- `up_proj`'s output rows -> `down_proj` (silu(gate) * up is linear in up's output).

For each pair, s = mean|x|^alpha over calibration tokens, alpha chosen on a grid to minimise
the summed output error ||X (Q(W s) / s - W)^T||^2 of the pair's Linears, Q being the
quantize-dequantize image on the scheme's grid
(`compress.families.causal_lm.algorithms.qat.fake_quantize`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from compress.families.causal_lm.algorithms.qat import fake_quantize

ALPHAS = tuple(i / 20 for i in range(21))


@dataclass
class Pair:
    """Linears sharing one input, and what produces that input (a norm or a Linear)."""

    name: str
    producer: nn.Module  # its weight (norm) or weight rows (Linear) are divided by s
    linears: list[nn.Linear]


def pairs_of(model: nn.Module) -> list[Pair]:
    """The scalable pairs of every Llama-style decoder layer (others are skipped)."""
    found: list[Pair] = []
    layers = getattr(getattr(model, "model", model), "layers", [])
    for index, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        norm1 = getattr(layer, "input_layernorm", None)
        norm2 = getattr(layer, "post_attention_layernorm", None)
        if attn is not None and norm1 is not None and hasattr(attn, "q_proj"):
            found.append(Pair(f"layers.{index}.attn", norm1,
                              [attn.q_proj, attn.k_proj, attn.v_proj]))
        if mlp is not None and norm2 is not None and hasattr(mlp, "gate_proj"):
            found.append(Pair(f"layers.{index}.mlp", norm2, [mlp.gate_proj, mlp.up_proj]))
            found.append(Pair(f"layers.{index}.down", mlp.up_proj, [mlp.down_proj]))
    return found


@torch.no_grad()
def capture_inputs(model: nn.Module, pairs: list[Pair], batches: Iterable[torch.Tensor],
                   max_rows: int = 2048) -> dict[str, torch.Tensor]:
    """Up to `max_rows` input rows (tokens) of each pair's first Linear, float32."""
    seen: dict[str, list[torch.Tensor]] = {p.name: [] for p in pairs}

    def hook(name: str):
        def keep(_module, args):
            rows = args[0].reshape(-1, args[0].shape[-1]).float()
            have = sum(len(r) for r in seen[name])
            if have < max_rows:
                seen[name].append(rows[: max_rows - have].clone())
        return keep

    handles = [p.linears[0].register_forward_pre_hook(hook(p.name)) for p in pairs]
    try:
        for ids in batches:
            model(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(rows) for name, rows in seen.items() if rows}


@torch.no_grad()
def pair_error(inputs: torch.Tensor, linears: list[nn.Linear], scales: torch.Tensor,
               scheme: str, group_size: int) -> float:
    """Summed squared output error of the pair's Linears quantized after scaling."""
    total = 0.0
    for linear in linears:
        weight = linear.weight.float()
        quantized = fake_quantize(weight * scales, scheme, group_size) / scales
        total += float(((inputs @ (quantized - weight).T) ** 2).sum())
    return total


def best_scales(inputs: torch.Tensor, linears: list[nn.Linear], scheme: str,
                group_size: int) -> tuple[torch.Tensor, float, float, float]:
    """(scales, alpha, error with them, error without) for one pair."""
    magnitude = inputs.abs().mean(0).clamp_min(1e-5)
    plain = pair_error(inputs, linears, torch.ones_like(magnitude), scheme, group_size)
    best = (torch.ones_like(magnitude), 0.0, plain)
    for alpha in ALPHAS[1:]:
        scales = magnitude ** alpha
        scales = scales / (scales.max() * scales.min()).sqrt()
        error = pair_error(inputs, linears, scales, scheme, group_size)
        if error < best[2]:
            best = (scales, alpha, error)
    return best[0], best[1], best[2], plain


@torch.no_grad()
def fold(pair: Pair, scales: torch.Tensor) -> None:
    """Divide the producer by `scales` and multiply the Linears' input columns by them:
    the float model computes the same function."""
    weight = pair.producer.weight
    if weight.dim() == 1:  # a norm's per-channel weight
        weight.div_(scales.to(weight.dtype))
    else:  # a Linear's output rows (and bias)
        weight.div_(scales.to(weight.dtype)[:, None])
        if getattr(pair.producer, "bias", None) is not None:
            pair.producer.bias.div_(scales.to(weight.dtype))
    for linear in pair.linears:
        linear.weight.mul_(scales.to(linear.weight.dtype)[None, :])


def equalize(model: nn.Module, batches: Iterable[torch.Tensor], scheme: str,
             group_size: int = 32) -> dict[str, float]:
    """Scale every pair of `model` in place for `scheme`; figures for the manifest: pairs
    scaled, and the summed output error of all pairs on the calibration rows before and
    after (relative)."""
    pairs = pairs_of(model)
    inputs = capture_inputs(model, pairs, batches)
    before = after = 0.0
    scaled = 0
    alphas = []
    for pair in pairs:
        if pair.name not in inputs:
            continue
        scales, alpha, error, plain = best_scales(inputs[pair.name], pair.linears, scheme,
                                                  group_size)
        before, after = before + plain, after + error
        alphas.append(alpha)
        if alpha > 0:
            fold(pair, scales)
            scaled += 1
    return {"equalized_pairs": scaled, "equalize_pairs_seen": len(alphas),
            "equalize_alpha_mean": round(sum(alphas) / max(len(alphas), 1), 3),
            "equalize_error_ratio": round(after / before, 4) if before else 1.0}

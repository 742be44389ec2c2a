"""SmoothQuant's activation smoothing (Xiao et al., 2023) before static int8 activations.

Static int8 gives each Linear's input one scale per tensor, so a few channels with large
activations (BERT's and MiniLM's hidden states have them) leave the other channels a handful
of levels. Dividing input channel j by s_j and multiplying the weight's column j by s_j
leaves the float product unchanged and moves the outliers into the weights, which are
quantized per output channel and absorb them:

    s_j = max|x_j|^alpha / max|W_j|^(1 - alpha)

over calibration text. In a post-LayerNorm encoder (BERT) the norm's output also feeds the
residual, so the division cannot be folded into the norm as in a pre-norm decoder
(`compress.families.causal_lm.algorithms.equalize`): it stays an explicit multiply before
the Linear (`SmoothedLinear`), which Inductor fuses into the quantize op of the input.
Linears reading the same tensor (query, key and value) share one s and one multiply.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable

import torch
from torch import nn

FLOOR = 1e-5  # no scale or statistic below this (an all-zero channel stays as it is)


class SmoothedLinear(nn.Module):
    """`linear(x * inv_scale)`, its weight's columns multiplied by the scale beforehand."""

    def __init__(self, linear: nn.Linear, inv_scale: torch.Tensor):
        super().__init__()
        self.linear = linear
        self.register_buffer("inv_scale", inv_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * self.inv_scale)


@torch.no_grad()
def input_statistics(model: nn.Module, run: Callable[[], None]
                     ) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """Per Linear (by name), the largest |x| of each input channel while `run()` drives the
    model over calibration data, and the groups of Linears that read the same tensor."""
    absmax: dict[str, torch.Tensor] = {}
    groups: list[list[str]] = []
    last: list[torch.Tensor | None] = [None]  # the input the previous Linear read

    def observe(name: str) -> Callable:
        def hook(_module: nn.Module, args: tuple) -> None:
            x = args[0]
            peak = x.detach().abs().reshape(-1, x.shape[-1]).amax(0).float()
            if name not in absmax:  # first call: consecutive readers of one tensor group
                if last[0] is x:
                    groups[-1].append(name)
                else:
                    groups.append([name])
            absmax[name] = peak if name not in absmax else torch.maximum(absmax[name], peak)
            last[0] = x
        return hook

    handles = [m.register_forward_pre_hook(observe(n)) for n, m in model.named_modules()
               if isinstance(m, nn.Linear)]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
        last[0] = None
    return absmax, groups


@torch.no_grad()
def smooth_linears(model: nn.Module, absmax: dict[str, torch.Tensor],
                   groups: Iterable[list[str]], alpha: float,
                   keep_float: Iterable[str] = ()) -> int:
    """Replace each observed Linear (not matching a `keep_float` pattern) by a
    `SmoothedLinear` with SmoothQuant's scales of strength `alpha`; Linears of one group
    share their scale (the largest weight column of the group). Returns how many."""
    patterns = list(keep_float)
    modules = dict(model.named_modules())
    smoothed = 0
    for group in groups:
        names = [n for n in group if not any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if not names:
            continue
        weight_peak = torch.stack([modules[n].weight.abs().amax(0) for n in names]).amax(0)
        peak = absmax[names[0]]
        scale = (peak.clamp_min(FLOOR).pow(alpha)
                 / weight_peak.float().clamp_min(FLOOR).pow(1 - alpha)).clamp_min(FLOOR)
        # a channel calibration never saw (or a dead weight column) is left as it is: its
        # scale would be set by the floor and blow up an input it meets later
        scale = torch.where((peak > FLOOR) & (weight_peak.float() > FLOOR), scale,
                            torch.ones_like(scale))
        inv_scale = (1 / scale).to(weight_peak.dtype)
        for name in names:
            linear = modules[name]
            linear.weight.mul_(scale.to(linear.weight.dtype))
            owner, _, attr = name.rpartition(".")
            setattr(modules[owner] if owner else model, attr, SmoothedLinear(linear, inv_scale))
            smoothed += 1
    return smoothed

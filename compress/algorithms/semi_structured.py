"""Semi-structured n:m pruning: in every group of m consecutive weights along a Linear's
input dimension, the n of highest score stay and the others become exact zeros (2:4 is
the pattern sparse kernels read: two values and two 2-bit positions per four weights).

Scores are |W| (magnitude) or Wanda's |W| x ||X_j||_2 (Sun et al., 2023): each weight's
magnitude times the L2 norm of the input feature it multiplies, over calibration inputs,
so a large weight on a feature that is nearly always zero can go. The masks are the ones
`compress.algorithms.pruning.apply_masks` re-applies after every recovery step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn

from compress.algorithms.pruning import Masks, apply_masks

Forward = Callable[[nn.Module, Any], Any]


def n_m_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Boolean keep-mask of an (out, in) score matrix: the n highest of every m consecutive
    inputs of each row (ties go to the lower position); `in` must be a multiple of m."""
    rows, columns = scores.shape
    if columns % m:
        raise ValueError(f"{columns} inputs are not a whole number of groups of {m}")
    groups = scores.reshape(rows, columns // m, m)
    order = torch.sort(groups, dim=-1, descending=True, stable=True).indices[..., :n]
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, order, True)
    return mask.reshape(rows, columns)


def split_by_group(layers: dict[str, nn.Module], m: int
                   ) -> tuple[dict[str, nn.Linear], list[str]]:
    """The Linears whose inputs are whole groups of m, and the names of every other layer
    (a Conv2d, or a Linear whose in_features m does not divide): those are left dense."""
    fit = {name: layer for name, layer in layers.items()
           if isinstance(layer, nn.Linear) and layer.in_features % m == 0}
    return fit, [name for name in layers if name not in fit]


def real_tokens(batch: Any) -> torch.Tensor | None:
    """The batch's real (unpadded) tokens as a (batch, length) boolean mask: its tokenizer's
    `attention_mask`; None for a batch without one (every position counts)."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    return None if mask is None else mask.bool()


@torch.no_grad()
def input_norms(model: nn.Module, layers: dict[str, nn.Linear], batches: Iterable[Any],
                forward: Forward, tokens: Callable[[Any], torch.Tensor | None] = real_tokens
                ) -> dict[str, torch.Tensor]:
    """L2 norm of each input feature of each Linear in `layers` over every real token of
    `batches` (float32, one value per input column), gathered by forward pre-hooks while
    `forward(model, batch)` runs each batch in eval mode. A Linear whose input has the
    batch's (batch, length) shape counts only the positions `tokens(batch)` marks, so padding
    does not weigh on the scores; other inputs (a pooled head's) count whole."""
    squares = {name: torch.zeros(layer.in_features) for name, layer in layers.items()}
    mask: torch.Tensor | None = None

    def hook(name: str):
        def add(_module: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            if mask is not None and x.shape[:-1] == mask.shape:
                x = x[mask.to(x.device)]
            x = x.reshape(-1, x.shape[-1]).float()
            squares[name] += x.pow(2).sum(dim=0).cpu()
        return add

    handles = [layer.register_forward_pre_hook(hook(name)) for name, layer in layers.items()]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            mask = tokens(batch)
            forward(model, batch)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return {name: total.sqrt() for name, total in squares.items()}


def n_m_masks(layers: dict[str, nn.Linear], n: int, m: int,
              norms: dict[str, torch.Tensor] | None = None) -> Masks:
    """Keep-masks of pattern n:m: by |W|, or by |W| x input norm (Wanda) where `norms`
    has the layer's input norms."""
    masks = {}
    for name, layer in layers.items():
        scores = layer.weight.detach().abs().float()
        if norms is not None:
            scores = scores * norms[name].to(scores.device)[None, :]
        masks[name] = n_m_mask(scores, n, m)
    return masks


def prune_n_m(layers: dict[str, nn.Module], n: int, m: int,
              norms: dict[str, torch.Tensor] | None = None
              ) -> tuple[Masks, dict[str, nn.Linear], list[str]]:
    """Prune every Linear of `layers` whose inputs are whole groups of m to n:m in place;
    (the masks, the pruned Linears, the names of the layers left dense)."""
    pruned, skipped = split_by_group(layers, m)
    masks = n_m_masks(pruned, n, m, norms)
    apply_masks(pruned, masks)
    return masks, pruned, skipped


def group_nonzeros(weight: torch.Tensor, m: int) -> torch.Tensor:
    """Non-zeros in each group of m consecutive inputs of a 2-D weight: (out, in / m)."""
    rows, columns = weight.shape
    return (weight.detach() != 0).reshape(rows, columns // m, m).sum(dim=-1)


def broken_layers(layers: dict[str, nn.Linear], n: int, m: int) -> list[str]:
    """Names of the Linears of `layers` with more than n non-zeros in some group of m."""
    return [name for name, layer in layers.items()
            if int(group_nonzeros(layer.weight, m).max()) > n]


def check_n_m(module: nn.Module, n: int, m: int, include: Sequence[str] = ("*",),
              exclude: Sequence[str] = ()) -> list[str]:
    """Names of the Linears of `module` (those matching an `include` and no `exclude`
    fnmatch pattern, whose in_features m divides) with more than n non-zeros in some group
    of m consecutive inputs: the ones that break the pattern. Empty when all hold it."""
    linears = {name: layer for name, layer in module.named_modules()
               if isinstance(layer, nn.Linear) and layer.in_features % m == 0
               and any(fnmatch(name, p) for p in include)
               and not any(fnmatch(name, p) for p in exclude)}
    return broken_layers(linears, n, m)


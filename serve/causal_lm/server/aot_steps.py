"""Decode steps compiled ahead of time by AOTInductor (torch and transformers only; shipped
in the `causal_lm` package): exported at package time (`export_steps`), loaded by a worker
in about a second each (`load_steps`), where torch.compile traced each graph with Dynamo for
about 10 s as the worker started.

A step is one AOTInductor package for one row and one for 2..N rows (a graph specialized to
one row decodes ~9% faster than the dynamic one at one row; measured). Each takes the
static cache's tensors as inputs it writes in place (`StepInputs`), and the model's weights
as constants the worker hands it from its own model (`load_constants`, user-managed: no
copy, a package of a few MB). The package's C++ runner has no Dynamo frame or guards
between tokens: on a 2-core Zen 4 (llm_int8) a step decoded 146 tok/s at one row against
129 for torch.compile's C++ wrapper, and 399 against 366 at 8 rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from serve import worker_temp

from ..runtime.attention import attention
from ..runtime.decode import StaticDecoder

ONE, ROWS = "decode_1.pt2", "decode_rows.pt2"  # the packages, in the archive's compiled_graphs/


class StepInputs(nn.Module):
    """A decoder's step as a module of plain tensors (what torch.export takes): the cache's
    keys, values and lengths come in as inputs and are written in place."""

    def __init__(self, decoder: StaticDecoder):
        super().__init__()
        self.model, self.decoder = decoder.model, decoder

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor,
                position_ids: torch.Tensor, mask: torch.Tensor, window: torch.Tensor,
                keys: list[torch.Tensor], values: list[torch.Tensor],
                lengths: list[torch.Tensor]) -> torch.Tensor:
        for layer, k, v, n in zip(self.decoder.cache.layers, keys, values, lengths,
                                  strict=True):
            layer.keys, layer.values, layer.cumulative_length = k, v, n
        with attention(self.model, self.decoder.attention):
            return self.decoder._forward(tokens, positions, position_ids, mask, window)


def cache_tensors(cache: Any) -> tuple[list[torch.Tensor], ...]:
    """A static cache's keys, values and lengths, layer by layer."""
    layers = cache.layers
    return ([x.keys for x in layers], [x.values for x in layers],
            [x.cumulative_length for x in layers])


def export_steps(model: nn.Module, rows: int, cache_len: int, mode: str, out: Path) -> None:
    """Export and compile the decode step of `model` for one row and, where `rows` > 1, for
    2..`rows` rows, into AOTInductor packages in `out` (Inductor's max-autotune where `mode`
    says so; the weights left out, `load_steps` hands them over)."""
    options = {"max_autotune": mode == "max-autotune", "freezing": False,
               "aot_inductor.package_constants_in_so": False,
               # max-autotune's C++ GEMM template packs a float Linear's weight (a MoE
               # router's, a float model's) into a constant of its own, which a worker
               # could not hand over: float products stay ATen's
               "max_autotune_gemm_backends": "ATEN"}
    window = torch.export.Dim("window", min=2, max=cache_len - 1)
    for size, name in ((1, ONE), (rows, ROWS)) if rows > 1 else ((1, ONE),):
        decoder = StaticDecoder(model, cache_len, always_mask=True)
        decoder.allocate(size, dynamic_rows=size > 1)
        dim = torch.export.Dim("rows", min=2, max=size) if size > 2 else None
        batch = {0: dim} if dim is not None else None
        keys, values, lengths = cache_tensors(decoder.cache)
        example = (torch.zeros(size, 1, dtype=torch.long), torch.tensor([4]),
                   torch.full((size, 1), 4), torch.ones(size, cache_len, dtype=torch.long),
                   torch.empty(5, dtype=torch.int8), keys, values, lengths)
        shapes = (batch, None, batch, batch, {0: window}, [batch] * len(keys),
                  [batch] * len(values), [None] * len(lengths))
        with torch.no_grad():
            program = torch.export.export(StepInputs(decoder), example, dynamic_shapes=shapes,
                                          strict=False)
        torch._inductor.aoti_compile_and_package(program, package_path=str(out / name),
                                                 inductor_configs=options)


class LoadedStep:
    """An AOTInductor package called as `StaticDecoder.step` (`use_step`), on the cache of
    the decoder it serves."""

    def __init__(self, package: Any, decoder: StaticDecoder):
        self.package, self.decoder = package, decoder

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor,
                 position_ids: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 window: torch.Tensor | None = None) -> torch.Tensor:
        rows = tokens.shape[0]
        if position_ids is None:  # no row padded: every row at the cache position
            position_ids = positions.view(1, 1).repeat(rows, 1)
        if mask is None:
            mask = torch.ones(rows, self.decoder.max_cache_len, dtype=torch.long)
        return self.package(tokens, positions, position_ids, mask, window,
                            *cache_tensors(self.decoder.cache))


def use_step(decoder: StaticDecoder, package: Any) -> StaticDecoder:
    """Have `decoder` decode through `package` from now on."""
    decoder.step, decoder.compiled = LoadedStep(package, decoder), True
    return decoder


def load_steps(folder: Path, model: nn.Module) -> dict[int, Any]:
    """The packages shipped in `folder`, by the fewest rows each serves (1, and 2 where
    there is a package for 2..N rows), holding `model`'s own weights. Raises where a package
    does not load or names a weight the model lacks."""
    if not any((folder / name).is_file() for name in (ONE, ROWS)):
        return {}
    weights = dict(model.named_parameters(remove_duplicate=False))
    weights.update(model.named_buffers(remove_duplicate=False))
    steps = {}
    for fewest, name in ((1, ONE), (2, ROWS)):
        if not (folder / name).is_file():
            continue
        with worker_temp.extracting():  # its library and weights: in this worker's folder
            package = torch._inductor.aoti_load_package(str(folder / name))
        names = package.get_constant_fqns()
        missing = [n for n in names if n.removeprefix("model.") not in weights]
        if missing:
            raise ValueError(f"{name} needs weights the model lacks: {missing[:3]}")
        package.load_constants({n: weights[n.removeprefix("model.")] for n in names},
                               check_full_update=True, user_managed=True)
        steps[fewest] = package
    return steps

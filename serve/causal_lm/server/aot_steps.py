"""Decode steps and the prefill compiled ahead of time by AOTInductor (torch and
transformers only; shipped in the `causal_lm` package): exported at package time
(`export_steps`, `export_prefill`), loaded by a worker in about a second each (`load_steps`,
`load_prefill`), where torch.compile traced each graph with Dynamo for about 10 s as the
worker started (the prefill's two graphs took 480 s to compile at start on a 2-core Zen 1).

A step is one AOTInductor package for one row and one for 2..N rows (a graph specialized to
one row decodes ~9% faster than the dynamic one at one row; measured). Each takes the
static cache's tensors as inputs it writes in place (`StepInputs`), and the model's weights
as constants the worker hands it from its own model (`load_constants`, user-managed: no
copy, a package of a few MB). The package's C++ runner has no Dynamo frame or guards
between tokens: on a 2-core Zen 4 (llm_int8) a step decoded 146 tok/s at one row against
129 for torch.compile's C++ wrapper, and 399 against 366 at 8 rows.

The prefill is one package for 1 to N rows of 2 to `cache_len` positions (`PrefillInputs`:
`prefill.prefill_chunk` over the prefiller's workspace), its last position's logits only
(two where the graph tells one row from more: a float model's).
A prefill is compute-bound (the grouped products are 87% of an eager one), so the package
saves the eager prefill's per-operation overhead: on a 2-core Zen 1 (llm_int8, 34-41-token
chat prompts) 0.82x the eager prefill's time for one prompt, 0.97x for 8
(benchmarks/causal_lm/micro/prefill_kinds.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from serve import aoti_package, worker_temp

from ..runtime.attention import attention, decode_attention_for
from ..runtime.decode import StaticDecoder
from ..runtime.static_cache import cache_tensors, empty_cache
from .speculation import verify_attention_of, verify_chunk

ONE, ROWS = "decode_1.pt2", "decode_rows.pt2"  # the packages, in the archive's compiled_graphs/
PREFILL, PREFILL_ONE = "prefill.pt2", "prefill_1.pt2"  # beside them (`export_prefill`)
VERIFY, VERIFY_ONE = "verify.pt2", "verify_1.pt2"  # speculation's (`export_verify`)


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


def inductor_options(mode: str) -> dict[str, Any]:
    """AOTInductor's settings for a package of `mode` (Inductor's max-autotune where it says
    so), the weights left out: the loader hands over the worker's own."""
    return {"max_autotune": mode == "max-autotune", "freezing": False,
            "aot_inductor.package_constants_in_so": False,
            # max-autotune's C++ GEMM template packs a float Linear's weight (a MoE router's,
            # a float model's) into a constant of its own, which a worker could not hand
            # over: float products stay ATen's
            "max_autotune_gemm_backends": "ATEN"}


def export_steps(model: nn.Module, rows: int, cache_len: int, mode: str, out: Path) -> None:
    """Export and compile the decode step of `model` for one row and, where `rows` > 1, for
    2..`rows` rows, into AOTInductor packages in `out` (`inductor_options`; the weights
    left out, `load_steps` hands them over)."""
    options = inductor_options(mode)
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
    return {fewest: load_package(folder / name, model)
            for fewest, name in ((1, ONE), (2, ROWS)) if (folder / name).is_file()}


def operators_loaded() -> bool:
    """Whether the kernel library's package operators are loaded in this process (not
    built for the asking: a model on the kernels loaded them)."""
    return hasattr(torch.ops.compress_lm, "package_run")


class OperatorLoader:
    """What `aoti_package.Package` calls of torch._C._aoti.AOTIModelPackageLoader, through
    the kernel library's operators (`runtime/csrc/package_runner.cpp`), whose run lets go
    of the GIL: through the binding, a step held it throughout, and the worker's other
    Python threads (the engine's event loop, the tokenizer) waited for the step to end."""

    def __init__(self, path: Path):
        with worker_temp.extracting():  # its library and weights: in this worker's folder
            self.handle = torch.ops.compress_lm.package_load(str(path), aoti_package.MODEL)

    def get_call_spec(self) -> list[str]:
        return torch.ops.compress_lm.package_call_spec(self.handle)

    def boxed_run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return torch.ops.compress_lm.package_run(self.handle, inputs)

    def get_constant_fqns(self) -> list[str]:
        return torch.ops.compress_lm.package_constant_fqns(self.handle)

    def load_constants(self, constants: dict[str, torch.Tensor], use_inactive: bool,
                       check_full_update: bool, user_managed: bool, allow_copy: bool) -> None:
        names = list(constants)
        torch.ops.compress_lm.package_load_constants(
            self.handle, names, [constants[n] for n in names], check_full_update, user_managed)


def load_package(path: Path, model: nn.Module) -> Any:
    """The AOTInductor package at `path`, holding `model`'s own weights (no copy), run with
    the GIL let go where the kernel library is loaded (`OperatorLoader`: every model on
    the kernels; a float model's packages hold it). Raises where it does not load or names
    a weight the model lacks."""
    weights = dict(model.named_parameters(remove_duplicate=False))
    weights.update(model.named_buffers(remove_duplicate=False))
    if operators_loaded():
        package = aoti_package.Package(OperatorLoader(path))
    else:
        package = aoti_package.load(path)  # its library and weights: in this worker's folder
    names = package.get_constant_fqns()
    missing = [n for n in names if n.removeprefix("model.") not in weights]
    if missing:
        raise ValueError(f"{path.name} needs weights the model lacks: {missing[:3]}")
    package.load_constants({n: weights[n.removeprefix("model.")] for n in names},
                           check_full_update=True, user_managed=True)
    return package


class PrefillInputs(nn.Module):
    """The prefill's chunk (`prefill.prefill_chunk`, in the decode attention) as a module of
    plain tensors: the workspace's keys, values and lengths come in as inputs and are
    written in place. `every_position`: speculation's verification instead
    (`speculation.verify_chunk`: every position's logits, in `verify_attention_of`'s
    attention)."""

    def __init__(self, model: nn.Module, cache: Any, last_only: bool,
                 every_position: bool = False):
        super().__init__()
        self.model, self.cache, self.last_only = model, cache, last_only
        self.every_position = every_position

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor, window: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor], lengths: list[torch.Tensor]) -> torch.Tensor:
        from .prefill import prefill_chunk

        for layer, k, v, n in zip(self.cache.layers, keys, values, lengths, strict=True):
            layer.keys, layer.values, layer.cumulative_length = k, v, n
        if self.every_position:
            with attention(self.model, verify_attention_of(self.model)):
                return verify_chunk(self.model, self.cache, ids, positions, position_ids,
                                    mask, window)
        with attention(self.model, decode_attention_for(self.model)):
            return prefill_chunk(self.model, self.cache, ids, positions, position_ids, mask,
                                 window, self.last_only)


def export_prefill(model: nn.Module, rows: int, cache_len: int, mode: str, out: Path,
                   last_only: bool = True) -> None:
    """Export and compile the prefill's chunk of `model` for 1..`rows` rows (at least 2) of
    2..`cache_len` positions into an AOTInductor package in `out` (`inductor_options`); where
    the graph tells one row from more (a float model's products: matmul folds a row of 1
    apart), one package for 1 row and one for 2..`rows`. Only a model run in the decode
    attention (`decode_attention_for`) has one: a chunk attends through the window of
    positions written."""
    if decode_attention_for(model) is None:
        raise ValueError("the prefill is exported for a model in the decode attention only")
    try:
        _export_prefill(model, 1, max(rows, 2), cache_len, mode, out / PREFILL, last_only)
    except torch._dynamo.exc.UserError:  # the rows' constraint: a row of 1 is guarded
        _export_prefill(model, 1, 1, cache_len, mode, out / PREFILL_ONE, last_only)
        _export_prefill(model, 2, max(rows, 2), cache_len, mode, out / PREFILL, last_only)


def export_verify(model: nn.Module, rows: int, cache_len: int, drafts: int, mode: str,
                  out: Path) -> None:
    """Export and compile speculation's verification of `model` (`speculation.verify_chunk`:
    every position's logits) for 1..`rows` rows of 2..`drafts`+1 positions (`drafts` at
    least 2) into an AOTInductor package in `out`, two where the graph tells one row from
    more (as `export_prefill`)."""
    if drafts < 2:
        raise ValueError("a verification package takes 2 drafts or more")
    try:
        _export_prefill(model, 1, max(rows, 2), cache_len, mode, out / VERIFY, False,
                        drafts + 1)
    except torch._dynamo.exc.UserError:
        _export_prefill(model, 1, 1, cache_len, mode, out / VERIFY_ONE, False, drafts + 1)
        _export_prefill(model, 2, max(rows, 2), cache_len, mode, out / VERIFY, False,
                        drafts + 1)


def _export_prefill(model: nn.Module, fewest: int, most: int, cache_len: int, mode: str,
                    path: Path, last_only: bool, verify_width: int = 0) -> None:
    """The prefill's package for `fewest`..`most` rows at `path` (`verify_width`: a
    verification's of 2..that many positions instead)."""
    widest = verify_width or cache_len
    count, length = min(most, 2), min(6, widest)  # sizes unlike each other: no two dims fused
    end = 4 + length
    cache = empty_cache(model, count, cache_len, dynamic_rows=True)
    # tensors of their own: as views of the cache's one buffer, AOTAutograd would guard
    # that they do not overlap at the example's rows, fixing the rows to the example's
    keys, values, lengths = ([t.clone() for t in ts] for ts in cache_tensors(cache))
    rows = torch.export.Dim("rows", min=fewest, max=most) if most > fewest else None
    batch = {0: rows} if rows is not None else None
    chunk = torch.export.Dim("chunk", min=2, max=widest)
    window = torch.export.Dim("window", min=2, max=cache_len)
    example = (torch.zeros(count, length, dtype=torch.long), torch.arange(4, end),
               torch.arange(4, end).repeat(count, 1),
               torch.ones(count, cache_len, dtype=torch.long), torch.empty(end, dtype=torch.int8),
               keys, values, lengths)
    shapes = ({0: rows, 1: chunk}, {0: chunk}, {0: rows, 1: chunk}, batch, {0: window},
              [batch] * len(keys), [batch] * len(values), [None] * len(lengths))
    from torch.fx.experimental import _config

    with torch.no_grad(), _config.patch(backed_size_oblivious=True):  # 1 row: no graph apart
        program = torch.export.export(PrefillInputs(model, cache, last_only,
                                                    every_position=bool(verify_width)),
                                      example, dynamic_shapes=shapes, strict=False)
        torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                 inductor_configs=inductor_options(mode))


class LoadedPrefill:
    """The prefill's AOTInductor packages (by the fewest rows each serves) called as
    `prefill.prefill_chunk`, exported for at most `rows` rows and `last_only` (what a chunk
    outside them asks runs eagerly)."""

    def __init__(self, packages: dict[int, Any], rows: int, last_only: bool):
        self.packages, self.rows, self.last_only = packages, max(rows, 2), last_only

    def __call__(self, model: nn.Module, cache: Any, ids: torch.Tensor,
                 positions: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                 window: torch.Tensor | None, last_only: bool) -> torch.Tensor:
        rows = ids.shape[0]
        if window is None or rows > self.rows or last_only != self.last_only:
            from .prefill import prefill_chunk

            return prefill_chunk(model, cache, ids, positions, position_ids, mask, window,
                                 last_only)
        package = self.packages[max(k for k in self.packages if k <= rows)]
        return package(ids, positions, position_ids, mask, window, *cache_tensors(cache))


def load_prefill(folder: Path, model: nn.Module, names: tuple[str, str] = (PREFILL, PREFILL_ONE)
                 ) -> dict[int, Any]:
    """The prefill's packages shipped in `folder` holding `model`'s weights, by the fewest
    rows each serves (empty: none is); `names`: (VERIFY, VERIFY_ONE) for speculation's."""
    rows, one = names
    if not (folder / rows).is_file():
        return {}
    if (folder / one).is_file():
        return {1: load_package(folder / one, model), 2: load_package(folder / rows, model)}
    return {1: load_package(folder / rows, model)}

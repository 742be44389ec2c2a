"""The stage registry: one `StageSpec` per stage kind, declared beside its config.

A stage kind is three things: a config class and a spec in `compress/recipe/kinds/<kind>.py`
(no torch import), and a run module `compress/stages/<kind>.py` with
`run(state, cfg, ctx) -> state`. The spec holds every trait the pipeline, validation,
data-parallel training, `compress bench`, the report and the benchmarks ask about, so no
code outside the kind's own modules names the kind. Specs are found by importing the modules
that `compress.recipe.kinds.KINDS` lists (the torchao config-to-handler registry is the model).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from compress.recipe.options import StrictModel

# A validation hook: (recipe, index of this stage) -> one line per problem.
Check = Callable[[Any, int], list[str]]


def _no_splits(cfg: Any) -> tuple[str, ...]:
    return ()


def _eager(config: dict[str, Any], metrics: dict[str, Any]) -> str:
    return "PyTorch eager"


def _no_precision(cfg: Any) -> str | None:
    return None


@dataclass(frozen=True)
class StageSpec:
    """Everything compress knows about one stage kind."""

    kind: str
    config: type[StrictModel]
    runner: str  # "module:function" with run(state, cfg, ctx) -> State, imported when it runs
    # (the family-independent runner; a family may name its own: `Family.runners`)
    order: int  # position in listings (`compress stages`, the recipe schema)
    makes_model: bool = True  # False: a leaf; the next stage continues from the model before
    takes_model: bool = True  # False: it takes an earlier stage's file (see `input_stage`)
    data_parallel: bool = False  # trains on every rank under torchrun (DDP)
    measured: bool = True  # accuracy and latency are measured after it
    reference: bool = False  # as the first stage, its model is what reports compare with
    code_modules: tuple[str, ...] = ()  # modules it runs beyond its runner: part of the cache key
    splits: Callable[[Any], tuple[str, ...]] = _no_splits  # data splits a config reads
    needs_before: tuple[str, ...] = ()  # kinds that must come earlier in the model's chain
    refused_before: tuple[str, ...] = ()  # kinds that must not come earlier in that chain
    precision: Callable[[Any], str | None] = _no_precision  # of what it makes (None: as is)
    runtime: Callable[[dict[str, Any], dict[str, Any]], str] = _eager  # (config, metrics)
    reload: str | None = None  # "module:function" (folder, config, threads) -> bundle
    input_stage: Callable[[Any, int], int | None] | None = None  # for takes_model=False
    check: Check | None = None  # its own rules (recipe, index) -> problems
    check_model: Callable[[Any, int, dict[str, Any]], list[str]] | None = None  # against
    # the recipe model's config.json (recipe, index, config) -> problems
    needs: Callable[[Any], tuple[str, ...]] = _no_splits  # hardware the run needs ("cuda")
    export_formats: Callable[[Any], tuple[str, ...]] | None = None  # its output is an export
    # folder (`export_dir`) in one of these formats, which a package stage can archive
    check_task: Callable[[Any, str, int], list[str]] | None = None  # (config, family, index)
    # -> problems: options that do not fit the model's family
    shipped_code: dict[str, tuple[str, ...]] = field(default_factory=dict)  # family ->
    # the packages its output ships (their folders, whole): part of the cache key

    def precision_of(self, config: dict[str, Any]) -> str | None:
        """`precision` of a config as recorded in a manifest (every option written out, so
        it is read as it is, not validated again)."""
        try:
            return self.precision(self.config.model_construct(**config))
        except (AttributeError, KeyError, TypeError, ValueError):
            return None

    def doc(self) -> str:
        """The one-line description of the kind (its config's first docstring line)."""
        return (self.config.__doc__ or "").strip().splitlines()[0]


_REGISTRY: dict[str, StageSpec] = {}
_DISCOVERED: list[bool] = []  # set once every kind module has been imported


def register(spec: StageSpec) -> StageSpec:
    """Add a kind's spec to the registry (called by each kind module)."""
    if spec.kind in _REGISTRY and _REGISTRY[spec.kind] is not spec:
        raise RuntimeError(f"stage kind {spec.kind!r} is registered twice")
    _REGISTRY[spec.kind] = spec
    return spec


def all_specs() -> dict[str, StageSpec]:
    """Every registered stage kind, in listing order."""
    if not _DISCOVERED:  # a spec module imported directly registers only itself
        from compress.recipe.kinds import KINDS

        for kind in KINDS:
            importlib.import_module(f"compress.recipe.kinds.{kind}")
        _DISCOVERED.append(True)
    return dict(sorted(_REGISTRY.items(), key=lambda item: item[1].order))


def spec_of(kind: str) -> StageSpec:
    """The spec of a stage kind (KeyError for an unknown kind)."""
    return all_specs()[kind]


def stage_configs() -> dict[str, type[StrictModel]]:
    """kind -> config class, in listing order."""
    return {kind: spec.config for kind, spec in all_specs().items()}


def import_function(target: str) -> Callable[..., Any]:
    """The function named by a `module:function` string."""
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


# Hardware a stage can need: name -> (what `validate` says, a torch-free probe).
def cuda_device_present() -> bool:
    """Whether an NVIDIA GPU is visible, without importing torch (driver device files)."""
    from pathlib import Path

    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or Path("/dev/nvidia0").exists()


def bf16_cpu_present() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX)."""
    from compress.runfolder.files import bf16_supported

    return bf16_supported()


HARDWARE: dict[str, tuple[str, Callable[[], bool]]] = {
    "cuda": ("a CUDA GPU", cuda_device_present),
    "bf16_cpu": ("a CPU that computes bfloat16 natively (AVX512-BF16 or AMX; elsewhere bf16 "
                 "is emulated and slower than fp32)", bf16_cpu_present),
}

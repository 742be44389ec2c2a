"""The served graphs of a causal-LM worker: its decoders, one per bucket, compiled and warmed
up as the handler serves them (`build_decoders`, `warm_up`), and the compiled graphs shipped
in its archive (torch and transformers only; shipped in the `causal_lm` package).

A worker that compiles at start spent about 50 s a bucket (180 s before it answered). The
package stage therefore runs this module in a process of its own (`python -m
serve.causal_lm.server.compiled_graphs EXPORT SETTINGS OUT`), which exports the decode steps as
AOTInductor packages (`aot_steps`), and the prefill beside them where `prefill_compile` is
on (the default), and ships them in the archive. A worker whose CPU
flags and torch match the packager's (`target`) loads the packages in about a second each
(`use_shipped`); where the export fails (a model torch.export cannot take), the package
stage ships Inductor's cache of the compiled decoders instead (FX graphs, AOTAutograd
entries, the C++ libraries built from them, max-autotune's choices), from which a worker
still traces each graph with Dynamo (~10 s each) but compiles nothing. Both are built for
the packager's CPU (-march=native), so on another CPU the worker says so in one line and
compiles afresh. Measured (2-core Zen 4, llm_int8): `torch.compiler.save_cache_artifacts`
ships the generated source, not the libraries, and its load compiled them again with g++
(18.5 s a bucket against 8.2 s). The cache's copy and the packages' extraction go into the
worker's own temporary folder (`serve.worker_temp`), removed when the worker ends or, where
it was killed, by the next worker."""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from serve import worker_temp
from serve.handler_settings import HandlerSettings

from ..runtime.decode import StaticDecoder
from . import aot_steps
from .buckets import shared_caches
from .prefill import last_only

logger = logging.getLogger(__name__)
TARGET = "target.json"  # the CPU, torch and settings the shipped graphs were built for
INDUCTOR = "inductor"  # the shipped Inductor cache, in the archive's `compiled_graphs/`
FOLDER = "compiled_graphs"  # at the archive's root
CPU_PREFIXES = ("avx", "amx", "fma", "f16c", "bmi", "sse", "vnni")  # what -march=native uses


def target() -> dict[str, Any]:
    """This machine's CPU vector flags, architecture and torch version."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    flags = sorted(f for f in line.partition(":")[2].split() if f.startswith(CPU_PREFIXES))
    return {"torch": torch.__version__, "machine": platform.machine(), "cpu_flags": flags}


def first_line(error: BaseException) -> str:
    """An error's first line (its kind where it says nothing)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def shapes_of(settings: HandlerSettings) -> dict[str, Any]:
    """What of a worker's `handler:` settings its graphs are built for."""
    return {"cache_len": settings.cache_len, "rows": settings.rows, "compile": settings.compile}


def use_shipped(folder: Path, model: nn.Module, settings: HandlerSettings | None = None
                ) -> tuple[dict[int, Any], Any, str]:
    """The decode steps shipped in `folder` for this CPU and torch, and for the cache and
    rows of `settings` (the handler's), holding `model`'s weights
    (`aot_steps.load_steps`; empty where none are), with Inductor's cache pointed at a copy
    of the one shipped; the prefill shipped with them (`aot_steps.LoadedPrefill`, None where
    none is); and what happened, in words."""
    if not (folder / TARGET).is_file():
        return {}, None, "no compiled graphs shipped: compiling at start"
    shipped, here = json.loads((folder / TARGET).read_text()), target()
    built_for = shipped.pop("shapes", None)
    if shipped != here:
        differ = [k for k in here if shipped.get(k) != here[k]]
        missing = sorted(set(shipped.get("cpu_flags", ())) - set(here["cpu_flags"]))
        logger.warning("compress worker: the shipped compiled graphs were built for another "
                       "%s%s: compiling afresh", " and ".join(differ),
                       f" (this CPU lacks {', '.join(missing)})" if missing else "")
        return {}, None, "shipped graphs refused: compiling afresh"
    if settings is not None and built_for is not None and built_for != shapes_of(settings):
        logger.warning("compress worker: the shipped compiled graphs were built for %s, this "
                       "worker serves %s: compiling afresh", built_for, shapes_of(settings))
        return {}, None, "shipped graphs refused: compiling afresh"
    if (folder / INDUCTOR).is_dir():  # a copy in this worker's own folder, gone with it
        cache = Path(tempfile.mkdtemp(prefix="compress-inductor-", dir=worker_temp.folder()))
        shutil.copytree(folder / INDUCTOR, cache, dirs_exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    try:
        # built for this CPU's flags and torch (checked above): loaded by AOTInductor's C++
        # loader, with no g++ probe of the CPU's vector ISA (`serve/aoti_package.py`)
        steps = aot_steps.load_steps(folder, model)
        prefill = aot_steps.load_prefill(folder, model) if steps else {}
    except (RuntimeError, ValueError) as error:
        logger.warning("compress worker: the shipped decode steps did not load (%s): "
                       "compiling afresh", first_line(error))
        return {}, None, "shipped steps refused: compiling afresh"
    loaded = aot_steps.LoadedPrefill(prefill, settings.rows_of(1) if settings else 2,
                                     last_only(model)) if prefill else None
    said = "shipped compiled graphs used"
    if steps:
        said = f"shipped decode steps{' and prefill' if prefill else ''} loaded"
    return steps, loaded, said


def use_shipped_verify(folder: Path, model: nn.Module) -> dict[int, Any]:
    """Speculation's verification packages shipped in `folder` beside the steps that
    `use_shipped` loaded (so for this CPU and torch), holding `model`'s weights, by the
    fewest rows each serves (empty: none shipped, or they did not load: said)."""
    try:
        return aot_steps.load_prefill(folder, model, (aot_steps.VERIFY, aot_steps.VERIFY_ONE))
    except (RuntimeError, ValueError) as error:
        logger.warning("compress worker: the shipped verification did not load (%s): "
                       "verifying eagerly", first_line(error))
        return {}


def build_decoders(model: nn.Module, sizes: list[int], cache_len: int, mode: str,
                   cpp_wrapper: bool, make: Callable[[], Any] | None = None,
                   steps: dict[int, Any] | None = None) -> dict[int, Any]:
    """One decoder per bucket size (`make()` where given, else a masked `StaticDecoder`):
    decoding through the shipped step for its rows (`steps`, by the fewest rows each
    serves), else compiled in `mode` unless "none": Inductor's C++ wrapper where asked,
    Dynamo's guards checked once a generation (`StaticDecoder.compile`)."""
    torch._dynamo.config.recompile_limit = max(8, 2 * len(sizes))  # a graph a bucket
    decoders = {}
    for rows in sizes:
        decoder = make() if make else StaticDecoder(model, cache_len, always_mask=True)
        package = (steps or {}).get(min(rows, 2))
        if package is not None:
            decoders[rows] = aot_steps.use_step(decoder, package)
        elif mode != "none":
            decoders[rows] = decoder.compile(mode, cpp_wrapper=cpp_wrapper, skip_guards=True)
        else:
            decoders[rows] = decoder
    return decoders


def warm_up(decoders: dict[int, Any], shared: bool,
            log: Callable[[str], None] = logger.info) -> None:
    """Run each decoder once, the largest first, so that each compiles now, not on a
    request. `shared` (continuous batching): the smaller ones' caches are views of the
    largest's, whose rows are dynamic: one graph serves every bucket of 2 rows or more, and
    one the bucket of 1 (Dynamo specializes a size of 1); a worker traces two graphs, not
    one a bucket. Compiling a decoder drops the graphs of those before it
    (`StaticDecoder.compile`): all are built before any runs."""
    if shared:
        decoders[max(decoders)].allocate(max(decoders), dynamic_rows=True)
        shared_caches(decoders)
    for n, rows in enumerate(sorted(decoders, reverse=True), 1):
        decoder = decoders[rows]
        compiling = decoder.compiled and not isinstance(decoder.step, aot_steps.LoadedStep)
        log(f"{'compiling' if compiling else 'warming up'} bucket {n} of "
            f"{len(decoders)} ({rows} rows)")
        decoder.generate([[0]] * rows, 2)


def precompile(export_dir: Path, settings: HandlerSettings, out: Path) -> None:
    """Export the decode steps a continuous-batching worker of `settings` serves
    (`aot_steps.export_steps`) and its prefill (`export_prefill`), or where the steps' export
    fails build and warm up its compiled decoders, over an empty Inductor cache in `out`;
    record the target they were built for."""
    from ..runtime import loading
    from .buckets import buckets

    out.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(out / INDUCTOR)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    lm = loading.load_folder(export_dir)
    cache_len, mode = settings.cache_len, settings.compile
    rows = settings.rows_of(1)
    try:
        aot_steps.export_steps(lm.model, rows, cache_len, mode, out)
        print("precompile: decode steps exported ahead of time", flush=True)
        if settings.prefill_compile:
            export_prefill(lm.model, rows, cache_len, mode, out)
        if settings.speculate >= 2:
            export_verify(lm.model, rows, cache_len, settings.speculate, mode, out)
        shutil.rmtree(out / INDUCTOR)  # the exports' own entries: no worker looks them up
    except Exception as error:  # noqa: BLE001 (any failure of torch.export or AOTInductor)
        for name in (aot_steps.ONE, aot_steps.ROWS):
            (out / name).unlink(missing_ok=True)
        print(f"precompile: the ahead-of-time export failed ({first_line(error)}): "
              "shipping Inductor's cache instead", flush=True)
        decoders = build_decoders(lm.model, buckets(rows), cache_len, mode,
                                  settings.cpp_wrapper)
        warm_up(decoders, shared=True, log=lambda line: print(f"precompile: {line}",
                                                              flush=True))
    built = target() | {"shapes": shapes_of(settings)}
    (out / TARGET).write_text(json.dumps(built, indent=1) + "\n")


def export_prefill(model: nn.Module, rows: int, cache_len: int, mode: str, out: Path) -> None:
    """Export the prefill beside the decode steps (`aot_steps.export_prefill`); where that
    fails, the archive ships none and its workers prefill eagerly (said in one line)."""
    try:
        aot_steps.export_prefill(model, rows, cache_len, mode, out, last_only(model))
        print("precompile: prefill exported ahead of time", flush=True)
    except Exception as error:  # noqa: BLE001 (any failure of torch.export or AOTInductor)
        for name in (aot_steps.PREFILL, aot_steps.PREFILL_ONE):
            (out / name).unlink(missing_ok=True)
        print(f"precompile: the prefill's ahead-of-time export failed ({first_line(error)}): "
              "its workers prefill eagerly", flush=True)


def export_verify(model: nn.Module, rows: int, cache_len: int, drafts: int, mode: str,
                  out: Path) -> None:
    """Export speculation's verification beside the decode steps
    (`aot_steps.export_verify`); where that fails, its workers verify eagerly (said)."""
    try:
        aot_steps.export_verify(model, rows, cache_len, drafts, mode, out)
        print("precompile: speculation's verification exported ahead of time", flush=True)
    except Exception as error:  # noqa: BLE001 (any failure of torch.export or AOTInductor)
        for name in (aot_steps.VERIFY, aot_steps.VERIFY_ONE):
            (out / name).unlink(missing_ok=True)
        print(f"precompile: the verification's ahead-of-time export failed "
              f"({first_line(error)}): its workers verify eagerly", flush=True)


if __name__ == "__main__":  # python -m serve.causal_lm.server.compiled_graphs EXPORT SETTINGS OUT
    precompile(Path(sys.argv[1]), HandlerSettings.from_config(json.loads(sys.argv[2])),
               Path(sys.argv[3]))

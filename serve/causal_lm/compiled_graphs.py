"""The served graphs of a causal-LM worker: its decoders, one per bucket, compiled and warmed
up as the handler serves them (`build_decoders`, `warm_up`), and the compiled graphs shipped
in its archive (torch and transformers only; shipped in the `causal_lm` package).

A worker that compiles at start spent about 50 s a bucket (180 s before it answered). The
package stage therefore runs this module in a process of its own (`python -m
causal_lm.compiled_graphs EXPORT SETTINGS OUT`), which builds the worker's graphs over an
empty Inductor cache and ships that cache in the archive (FX graphs, AOTAutograd entries,
the C++ libraries built from them, max-autotune's choices). A worker whose CPU flags and
torch match the packager's (`target`) starts from a copy of it (`use_shipped`): Dynamo
still traces each graph, but nothing is compiled. Inductor's libraries are built for the
packager's CPU (-march=native), so on another CPU the worker says so in one line and
compiles afresh. Measured (2-core Zen 4, llm_int8): a cache moved to another folder hits;
`torch.compiler.save_cache_artifacts` ships the generated source, not the libraries, and
its load compiled them again with g++ (18.5 s a bucket against 8.2 s)."""

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

from .buckets import shared_caches
from .decode import StaticDecoder

logger = logging.getLogger(__name__)
TARGET = "target.json"  # the CPU and torch the shipped graphs were built for
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


def use_shipped(folder: Path) -> str:
    """Point Inductor's cache at a copy of the graphs shipped in `folder`, where they were
    built for this CPU and torch; what happened, in words."""
    if not (folder / TARGET).is_file():
        return "no compiled graphs shipped: compiling at start"
    shipped, here = json.loads((folder / TARGET).read_text()), target()
    if shipped != here:
        differ = [k for k in here if shipped.get(k) != here[k]]
        missing = sorted(set(shipped.get("cpu_flags", ())) - set(here["cpu_flags"]))
        logger.warning("compress worker: the shipped compiled graphs were built for another "
                       "%s%s: compiling afresh", " and ".join(differ),
                       f" (this CPU lacks {', '.join(missing)})" if missing else "")
        return "shipped graphs refused: compiling afresh"
    cache = Path(tempfile.mkdtemp(prefix="compress-inductor-"))
    shutil.copytree(folder / INDUCTOR, cache, dirs_exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    return "shipped compiled graphs used"


def build_decoders(model: nn.Module, sizes: list[int], cache_len: int, mode: str,
                   cpp_wrapper: bool, make: Callable[[], Any] | None = None
                   ) -> dict[int, Any]:
    """One decoder per bucket size (`make()` where given, else a masked `StaticDecoder`),
    compiled in `mode` unless "none": Inductor's C++ wrapper where asked, Dynamo's guards
    checked once a generation (`StaticDecoder.compile`)."""
    torch._dynamo.config.recompile_limit = max(8, 2 * len(sizes))  # a graph a bucket
    decoders = {}
    for rows in sizes:
        decoder = make() if make else StaticDecoder(model, cache_len, always_mask=True)
        decoders[rows] = (decoder.compile(mode, cpp_wrapper=cpp_wrapper, skip_guards=True)
                          if mode != "none" else decoder)
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
        log(f"{'compiling' if decoder.compiled else 'warming up'} bucket {n} of "
            f"{len(decoders)} ({rows} rows)")
        decoder.generate([[0]] * rows, 2)


def precompile(export_dir: Path, settings: dict[str, Any], out: Path) -> None:
    """Build and warm up the graphs a continuous-batching worker of `settings` serves, over
    an empty Inductor cache in `out`, and record the target they were built for."""
    from . import runtime
    from .buckets import buckets, rows_of
    from .prefill import prefiller_of

    out.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(out / INDUCTOR)
    if settings.get("threads"):
        torch.set_num_threads(int(settings["threads"]))
    lm = runtime.load_folder(export_dir)
    cache_len, mode = int(settings.get("cache_len", 512)), settings.get("compile") or "none"
    decoders = build_decoders(lm.model, buckets(rows_of(settings, 1)), cache_len, mode,
                              bool(settings.get("cpp_wrapper")))
    warm_up(decoders, shared=True, log=lambda line: print(f"precompile: {line}", flush=True))
    prefiller_of(lm.model, settings, cache_len, mode != "none").warm_up()
    (out / TARGET).write_text(json.dumps(target(), indent=1) + "\n")


if __name__ == "__main__":  # python -m causal_lm.compiled_graphs EXPORT_DIR SETTINGS OUT
    precompile(Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3]))

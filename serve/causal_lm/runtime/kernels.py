"""compress's kernel library, `csrc/`'s C++ sources as torch operators, compiled on first
use for this CPU (part of the `causal_lm.runtime` package; imports torch only): the
grouped-weight kernels of `grouped_kernels.cpp`:
`torch.ops.compress_lm.grouped_pack(codes, scale, offset, bits, half)` lays a weight out for
`torch.ops.compress_lm.grouped_mm(x, packed, out_features, bits, half)` (`half`: scales and
offsets stored as float16, where they all are float16 values), and
`torch.ops.compress_lm.grouped_mm_int8` (same arguments) multiplies by x rounded to int8 per
group of 32 (`grouped_int8_activations.cpp`, one row as any), and
`torch.ops.compress_lm.grouped_mm_bf16` by x rounded to bfloat16 (`grouped_bf16_activations.cpp`,
AVX512-BF16's vdpbf16ps; a build without AVX512-BF16 is `grouped_mm`'s exact float32
product: `bf16_native` says which), and `torch.ops.compress_lm.sparse24_mm(x, packed,
out_features, bits)` multiplies by 2:4 sparse weights (`sparse24_kernel.cpp`, laid out by
`sparse24.py`'s `pack_records`), and `torch.ops.compress_lm.routed_experts` runs a MoE
layer's routed experts on their packed records (`routed_experts.cpp`, for `experts.py`), and
`torch.ops.compress_lm.cache_attention(query, key, value, valid, scale)` attends over a KV
cache so that a row's answer is its own whatever the batch (`cache_attention.cpp`, for
`attention.py`), and `torch.ops.compress_lm.package_load` / `package_run` run an
AOTInductor package with the GIL let go (`package_runner.cpp`, for the served steps:
`server/aot_steps.py`).

The build goes through `torch.utils.cpp_extension.load` into its cache (TORCH_EXTENSIONS_DIR,
by default ~/.cache/torch_extensions), under a name that carries the source, torch's version
and the CPU's vector flags, so a cache moved to another CPU builds again; it needs a C++
compiler and ninja (`pip install ninja`, in the `llm` extra). A library of that name lying
beside this module (`shipped_library`: a TorchServe archive carries the one built where it was
packaged) is loaded instead: a worker on the same CPU starts without the 13-15 s build, and
one on another CPU, whose name differs, builds its own. Where they are not at hand,
`grouped_mm_available` says False (with the reason in `build_error`) and the modules fall
back to torch operations. `COMPRESS_KERNEL_MARCH` (a `-march` value) builds for another CPU
level than this one's (the tests build the AVX2 paths so on an AVX-512 machine, and the
portable ones with x86-64); `grouped_mm_path` names the path `grouped_mm` was built with.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")  # the C++ sources, beside this file
SOURCE = CSRC / "grouped_kernels.cpp"  # the operators' registration
# every file of the build: float32 activations (and the layout), int8 ones, bfloat16 ones,
# 2:4 sparse weights (sparse24.py's), MoE experts (experts.py's), the batch-invariant
# attention (attention.py's), the shared layout
# what the compiler is given: one unit that includes every source, so torch's headers are
# parsed once a build (six units took about twice the compiler's CPU time: 151 s on a Zen 1)
UNIT = CSRC / "library.cpp"
SOURCES = (SOURCE, CSRC / "grouped_int8_activations.cpp", CSRC / "grouped_bf16_activations.cpp",
           CSRC / "sparse24_kernel.cpp", CSRC / "routed_experts.cpp",
           CSRC / "cache_attention.cpp", CSRC / "package_runner.cpp", CSRC / "grouped_layout.h",
           UNIT)
GROUP = 32  # inputs per group, fixed by the kernels
_state: dict[str, object] = {}


def _cpu_flags() -> set[str]:
    # serve/cpu_features.flags() does the same; this runtime ships alone, without it
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def _build_name(flags: set[str]) -> tuple[str, list[str]]:
    """The extension's name (source and CPU in it) and the compiler flags."""
    vector = sorted(f for f in flags if f.startswith(("avx512", "avx2", "fma")))
    # -fopenmp: at::parallel_for is inline OpenMP; without it the kernel runs on one core;
    # COMPRESS_KERNEL_MARCH builds for another CPU level (x86-64-v3: AVX2, no AVX-512)
    march = os.environ.get("COMPRESS_KERNEL_MARCH") or ("native" if vector else "")
    cflags = ["-O3", "-fopenmp"] + ([f"-march={march}"] if march else [])
    digest = hashlib.sha1(b"".join(path.read_bytes() for path in SOURCES)
                          + " ".join([*vector, *cflags, torch.__version__]).encode())
    return f"compress_lm_grouped_{digest.hexdigest()[:12]}", cflags


def shipped_library(folder: Path | None = None) -> Path:
    """Where the library built for this CPU lies when it ships beside this module (in
    `folder`, by default this file's)."""
    name, _ = _build_name(_cpu_flags())
    return (folder or Path(__file__).parent) / f"{name}.so"


def built_library() -> Path | None:
    """The library this process built or loaded from the extensions cache (None where the
    kernels are not at hand): what a package ships as `shipped_library`."""
    if not grouped_mm_available():
        return None
    from torch.utils.cpp_extension import _get_build_directory

    name, _ = _build_name(_cpu_flags())
    library = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    return library if library.is_file() else shipped_library() if shipped_library().is_file() \
        else None


def grouped_mm_available() -> bool:
    """Whether `torch.ops.compress_lm.grouped_mm` is registered (built here if need be)."""
    if "ok" not in _state:
        _state["ok"] = _load()
    return bool(_state["ok"])


def bf16_native() -> bool:
    """Whether `grouped_mm_bf16` rounds x to bfloat16 and multiplies on
    AVX512-BF16 (the kernels were built for a CPU that has it); where False it is
    `grouped_mm`'s exact float32 product, and so is the `activations: bf16` mode."""
    return grouped_mm_available() and bool(torch.ops.compress_lm.grouped_bf16_native())


def grouped_mm_path() -> str | None:
    """Which path `grouped_mm` multiplies with in this build: "avx512", "avx2" (AVX2 + FMA +
    F16C without AVX-512: batch-invariant at every row count) or "portable" (None where the
    kernels are not at hand)."""
    return str(torch.ops.compress_lm.grouped_mm_path()) if grouped_mm_available() else None


def build_error() -> str | None:
    """Why the kernels could not be built, or None."""
    return _state.get("error")  # type: ignore[return-value]


def _load() -> bool:
    if hasattr(torch.ops.compress_lm, "grouped_mm"):
        return True
    if os.environ.get("COMPRESS_NO_KERNELS"):
        _state["error"] = "COMPRESS_NO_KERNELS is set"
        return False
    if shipped_library().is_file():
        torch.ops.load_library(str(shipped_library()))
        _register_fake()
        return True
    from torch.utils.cpp_extension import load

    scripts = Path(sys.executable).parent  # pip's ninja, where this environment is not on PATH
    if shutil.which("ninja") is None and (scripts / "ninja").exists():
        os.environ["PATH"] = f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"
    name, cflags = _build_name(_cpu_flags())
    from torch.utils.cpp_extension import _get_build_directory

    if unheld_lock_removed(Path(_get_build_directory(name, verbose=False)) / "lock"):
        print(f"compress: removed a killed build's lock in {name}'s build folder",
              file=sys.stderr)
    try:
        load(name=name, sources=[str(UNIT)],
             extra_cflags=cflags, extra_ldflags=["-fopenmp"],
             is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as error:  # no compiler, or it failed
        _state["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        return False
    _register_fake()
    return True


def unheld_lock_removed(lock: Path) -> bool:
    """Remove `lock`, a torch extension build folder's lock file, when no process holds it
    open, and say whether it was: a build killed midway leaves it behind, and every later
    `torch.utils.cpp_extension.load` of that name then waits for it forever. The live
    build's process keeps the file open from taking the lock to releasing it (torch's
    FileBaton), so a lock no process has open (/proc/<pid>/fd) is a dead build's. Where
    /proc cannot say (not Linux), the lock stays. The same function as serve/encoder_attention.py's:
    the causal-LM runtime ships alone in export folders and an encoder archive ships
    no serve.causal_lm, so neither can import the other's; keep them in step."""
    if not lock.exists() or not Path("/proc/self/fd").is_dir():
        return False
    target = str(lock.resolve())
    for fd_folder in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fd_folder.iterdir()):
                return False
        except OSError:  # a process that ended, or another user's
            continue
    lock.unlink(missing_ok=True)
    return True


def _register_fake() -> None:
    @torch.library.register_fake("compress_lm::grouped_mm")
    def _(x: torch.Tensor, packed: torch.Tensor, n: int, bits: int, half: bool
          ) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("compress_lm::grouped_mm_int8")
    def _(x: torch.Tensor, packed: torch.Tensor, n: int, bits: int, half: bool
          ) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("compress_lm::grouped_mm_bf16")
    def _(x: torch.Tensor, packed: torch.Tensor, n: int, bits: int, half: bool
          ) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("compress_lm::routed_experts")
    def _(x: torch.Tensor, *args: object) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake("compress_lm::cache_attention")
    def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          valid: torch.Tensor | None, scale: float) -> torch.Tensor:
        rows, heads, length, dim = query.shape
        return query.new_empty(rows, length, heads, dim)

    @torch.library.register_fake("compress_lm::sparse24_mm")
    def _(x: torch.Tensor, packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], n)

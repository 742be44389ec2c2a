"""Encoder attention as a torch operator: `torch.ops.compress_encoder.attention(query, key,
value, mask, scale)` computes softmax(q k^T * scale + mask) v for bidirectional attention
(`encoder_attention.cpp`), with q, k, v of (batch, heads, length, head_dim) and the answer
laid out (batch, length, heads, head_dim), the layout the next projection reads. `mask` is
None, a bool mask (true keeps) or a float one added to the scores, broadcastable to
(batch, heads, length, length). `packed_attention(query, key, value, offsets, scale)` is the
same for texts packed one after another along the length of a (1, heads, tokens, head_dim)
batch, text s at positions [offsets[s], offsets[s + 1]): each sees its own tokens only, and
no padding is computed. `attention_quantized` and `packed_attention_quantized` take the
same arguments and then `smooth, out_scale, zero_point, quant_min, quant_max`: they return the
answer as the next int8 linear's uint8 input (after SmoothQuant's per-feature multiply
`smooth`, if any) instead of float32. The same library holds `add_layer_norm(input, residual,
weight, bias, eps, smooth, scale, zero_point, quant_min, quant_max)` (`encoder_norm.cpp`):
the residual add, LayerNorm and that quantization in one pass, returning (the float answer,
its quantized copy); `embed_layer_norm(tables, ids, weight, ...)`, the same for a sum of
embedding lookups (each `tables[k]` row picked by `ids[k]`, broadcast to one shape); and
`gelu_quantize(input, smooth, scale, zero_point, quant_min, quant_max)`
(`encoder_activation.cpp`): GELU, that multiply and the quantization in one pass.

On a CPU with AVX512-BF16 and a head of 32 or 64 both products run on bfloat16 pairs
(vdpbf16ps) with float32 sums and softmax: ~2x the float32 flash attention aten picks at
8 x 128 for MiniLM. Elsewhere it is float32 (AVX-512 blocks, or plain loops).

The library is built on first use for this CPU (a C++ compiler and ninja) into torch's
extensions cache, under a name carrying the source, torch's version and the CPU's vector
flags; one lying beside this file under that name (an archive carries the one built where it
was packaged) is loaded instead. `load()` says whether the operator is registered, `error()`
why not. Imports torch only: it ships inside archives.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

from serve import cpu_features

SOURCE = Path(__file__).with_name("encoder_attention.cpp")
NORM_SOURCE = Path(__file__).with_name("encoder_norm.cpp")
ACTIVATION_SOURCE = Path(__file__).with_name("encoder_activation.cpp")
# what the compiler is given: one unit that includes the three, torch's headers parsed once
UNIT = Path(__file__).with_name("encoder_library.cpp")
SOURCES = (SOURCE, NORM_SOURCE, ACTIVATION_SOURCE, UNIT)
NAMESPACE = "compress_encoder"
_state: dict[str, object] = {}


def vector_flags() -> list[str]:
    """The CPU's vector extensions from /proc/cpuinfo (empty where it cannot be read)."""
    return sorted(f for f in cpu_features.flags() if f.startswith(("avx512", "avx2", "fma")))


def library_name() -> tuple[str, list[str]]:
    """The library's name for this source, torch and CPU, and its compiler flags
    (`COMPRESS_KERNEL_MARCH` builds for another CPU level than this one's)."""
    vector = vector_flags()
    march = os.environ.get("COMPRESS_KERNEL_MARCH") or ("native" if vector else "")
    cflags = ["-O3", "-fopenmp"] + ([f"-march={march}"] if march else [])
    digest = hashlib.sha1(b"".join(source.read_bytes() for source in SOURCES)
                          + " ".join([*vector, *cflags, torch.__version__]).encode())
    return f"compress_encoder_attention_{digest.hexdigest()[:12]}", cflags


def shipped_library(folder: Path | None = None) -> Path:
    """Where the library for this CPU lies when it ships beside the source."""
    return (folder or SOURCE.parent) / f"{library_name()[0]}.so"


def built_library() -> Path | None:
    """The library file this process loaded (None where the operator is not at hand)."""
    if not load():
        return None
    if shipped_library().is_file():
        return shipped_library()
    from torch.utils.cpp_extension import _get_build_directory

    name = library_name()[0]
    library = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
    return library if library.is_file() else None


def load(folder: Path | None = None) -> bool:
    """Whether the library's operators are registered: the library for this CPU loaded from
    `folder` (an export folder, an archive's root) or from beside this file where it lies
    there, built here if need be."""
    if "ok" not in _state:
        _state["ok"] = _load(folder)
    return bool(_state["ok"])


def error() -> str | None:
    """Why the operator could not be built, or None."""
    return _state.get("error")  # type: ignore[return-value]


def unheld_lock_removed(lock: Path) -> bool:
    """Remove `lock`, a torch extension build folder's lock file, when no process holds it
    open, and say whether it was: a build killed midway leaves it behind, and every later
    `torch.utils.cpp_extension.load` of that name then waits for it forever. The live
    build's process keeps the file open from taking the lock to releasing it (torch's
    FileBaton), so a lock no process has open (/proc/<pid>/fd) is a dead build's. Where
    /proc cannot say (not Linux), the lock stays. The same function as
    serve/causal_lm/runtime/kernels.py's:
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


def _load(folder: Path | None) -> bool:
    if hasattr(getattr(torch.ops, NAMESPACE), "add_layer_norm"):
        return True
    if os.environ.get("COMPRESS_NO_KERNELS"):
        _state["error"] = "COMPRESS_NO_KERNELS is set"
        return False
    shipped = [p for p in (shipped_library(folder), shipped_library()) if p.is_file()]
    if shipped:
        torch.ops.load_library(str(shipped[0]))
    else:
        from torch.utils.cpp_extension import load as build

        scripts = Path(sys.executable).parent  # pip's ninja, where it is not on PATH
        if shutil.which("ninja") is None and (scripts / "ninja").exists():
            os.environ["PATH"] = f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"
        name, cflags = library_name()
        from torch.utils.cpp_extension import _get_build_directory

        if unheld_lock_removed(Path(_get_build_directory(name, verbose=False)) / "lock"):
            print(f"compress: removed a killed build's lock in {name}'s build folder",
                  file=sys.stderr)
        try:
            build(name=name, sources=[str(UNIT)], extra_cflags=cflags,
                  extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        except (RuntimeError, OSError, ImportError) as exc:  # no compiler, or it failed
            _state["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            return False

    @torch.library.register_fake(f"{NAMESPACE}::attention")
    def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        batch, heads, length, head_dim = query.shape
        return query.new_empty(batch, length, heads, head_dim)

    @torch.library.register_fake(f"{NAMESPACE}::packed_attention")
    def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor,
          scale: float) -> torch.Tensor:
        _, heads, tokens, head_dim = query.shape
        return query.new_empty(1, tokens, heads, head_dim)

    @torch.library.register_fake(f"{NAMESPACE}::attention_quantized")
    def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          mask: torch.Tensor | None, scale: float, smooth: torch.Tensor | None,
          out_scale: float, zero_point: int, quant_min: int, quant_max: int) -> torch.Tensor:
        batch, heads, length, head_dim = query.shape
        return query.new_empty(batch, length, heads, head_dim, dtype=torch.uint8)

    @torch.library.register_fake(f"{NAMESPACE}::packed_attention_quantized")
    def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor,
          scale: float, smooth: torch.Tensor | None, out_scale: float, zero_point: int,
          quant_min: int, quant_max: int) -> torch.Tensor:
        _, heads, tokens, head_dim = query.shape
        return query.new_empty(1, tokens, heads, head_dim, dtype=torch.uint8)

    @torch.library.register_fake(f"{NAMESPACE}::add_layer_norm")
    def _(input: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          bias: torch.Tensor, eps: float, smooth: torch.Tensor | None, scale: float,
          zero_point: int, quant_min: int, quant_max: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(input), torch.empty_like(input, dtype=torch.uint8)

    @torch.library.register_fake(f"{NAMESPACE}::embed_layer_norm")
    def _(tables: list[torch.Tensor], ids: list[torch.Tensor], weight: torch.Tensor,
          bias: torch.Tensor, eps: float, smooth: torch.Tensor | None, scale: float,
          zero_point: int, quant_min: int, quant_max: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = torch.broadcast_shapes(*(i.shape for i in ids)) + tables[0].shape[-1:]
        return tables[0].new_empty(shape), tables[0].new_empty(shape, dtype=torch.uint8)

    @torch.library.register_fake(f"{NAMESPACE}::gelu_quantize")
    def _(input: torch.Tensor, smooth: torch.Tensor | None, scale: float, zero_point: int,
          quant_min: int, quant_max: int) -> torch.Tensor:
        return torch.empty_like(input, dtype=torch.uint8)

    return True

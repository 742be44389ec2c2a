"""The run folder: atomic writes, digests, the run lock and the environment (the manifest's
typed records live in `compress.runfolder.records`)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from compress.errors import UserError

LIBRARIES = ("torch", "torchao", "transformers", "tokenizers", "onnx", "onnxruntime",
             "torchserve", "torch-model-archiver", "torch-tensorrt", "executorch", "pydantic",
             "numpy", "scikit-learn", "compress")
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16",
             "amx_int8")


_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    """Write `text` to `path` through a temporary file and a rename, both on disk (the file
    and its folder fsynced) when this returns. `mode`: the file's permissions (default
    0666 less the umask; 0o600 for a secret)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_UMASK if mode is None else mode)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def atomic_write_json(path: Path, data: Any, mode: int | None = None) -> None:
    """Atomically write `data` as indented JSON."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n", mode)


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when it is missing or unreadable (a cache entry a
    killed run left half-written counts as absent)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def fsync_folder(folder: Path) -> None:
    """Put a folder's entries (a rename into it) on disk; where a file system cannot fsync
    a folder, nothing."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(path: Path) -> None:
    """Put a file, or a folder and everything in it, on disk with the folder holding it."""
    path = Path(path)
    if path.is_dir():
        for child in sorted(path.rglob("*")):
            if child.is_file() and not child.is_symlink():
                _fsync_file(child)
            elif child.is_dir():
                fsync_folder(child)
        fsync_folder(path)
    elif path.is_file():
        _fsync_file(path)
    fsync_folder(path.parent)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_json(data: Any) -> str:
    """Hex sha256 of a JSON-serialisable value (keys sorted)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@contextlib.contextmanager
def run_lock(run_dir: Path, busy: str) -> Iterator[None]:
    """Hold the run folder's lock (one `compress run` or `bench` at a time); `busy` ends
    the error when another process holds it. A read-only folder cannot be rewritten by
    anyone, so it needs no lock."""
    try:
        fh = open(run_dir / ".lock", "w")  # noqa: SIM115 - closed below
    except OSError:
        yield
        return
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{run_dir}: {busy}") from None
        yield


def environment() -> dict[str, Any]:
    """Library versions, Python, CPU model, cores, ISA flags and torch threads."""
    import torch

    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    cpu_model, flags = _cpu_info()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "libraries": versions,
        "cpu": {"model": cpu_model, "cores": os.cpu_count(),
                "isa": {flag: flag in flags for flag in ISA_FLAGS}},
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }


def cpu_flags() -> set[str]:
    """The CPU's ISA flags (/proc/cpuinfo; empty where that cannot be read)."""
    return _cpu_info()[1]


def bf16_supported() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX; assumed where the
    flags cannot be read). Without it bf16 matrix products are emulated: on an AVX2-only
    EPYC a MiniLM training step took 21 s under bf16 autocast, 1.5 s in fp32."""
    flags = cpu_flags()
    return not flags or bool({"avx512_bf16", "amx_bf16"} & flags)


def _cpu_info() -> tuple[str, set[str]]:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "", platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return model, flags

"""llama.cpp's own server for benchmarks/causal_lm/served.py: `llama-server` and
`llama-quantize` built once from the llama.cpp source that llama-cpp-python's source
distribution carries (`vendor/llama.cpp`), for this CPU.

The build lives in `$COMPRESS_LLAMA_SERVER`, default `~/.cache/compress/llama-server/`:
`pip download llama-cpp-python --no-binary :all: --no-deps`, unpacked; cmake with
`-DGGML_NATIVE=ON` (ggml for this CPU's instruction sets), static libraries, no curl, no
OpenSSL and no web UI download (these machines reach no hub); the two targets built under
`nice -n 19` with `-j 2`, their binaries copied to `bin/`, the source and build trees
removed. A marker written last (`.compress-llama-server-ready`, with the versions, the
cmake flags and the build's seconds) tells a finished build from a half-made one, which is
made again.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness.venv import PeerError, call

DIR_VAR, DEFAULT_DIR = "COMPRESS_LLAMA_SERVER", "~/.cache/compress/llama-server"
READY = ".compress-llama-server-ready"  # written once every build step has succeeded
PACKAGE = "llama-cpp-python"
TARGETS = ("llama-server", "llama-quantize")
JOBS = 2  # compile jobs: the build shares the machine, at the lowest priority
CMAKE_FLAGS = ("-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
               "-DBUILD_SHARED_LIBS=OFF", "-DCMAKE_BUILD_TYPE=Release")


def build_dir() -> Path:
    """`$COMPRESS_LLAMA_SERVER`, else ~/.cache/compress/llama-server."""
    return Path(os.environ.get(DIR_VAR) or DEFAULT_DIR).expanduser()


def binary(folder: Path, name: str) -> Path:
    return folder / "bin" / name


def ensure_llama_server(folder: Path, echo: Callable[[str], None]) -> dict[str, Any]:
    """Build llama-server and llama-quantize into `folder` unless its marker says they are
    built; the marker's facts (binaries, versions, cmake flags, build seconds)."""
    marker = folder / READY
    if marker.is_file():
        try:
            facts = dict(json.loads(marker.read_text()))
            if all(binary(folder, t).is_file() for t in TARGETS):
                return facts
        except (ValueError, TypeError):
            pass
        echo(f"serve_peers_llm: {marker} does not describe a finished build; building again")
    if folder.exists():
        if not folder.is_dir():
            raise PeerError(f"{folder} exists and is not a folder; remove it or set "
                            f"{DIR_VAR} to another folder")
        echo(f"serve_peers_llm: {folder} is a half-made build; making it again")
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    log = folder / "build.log"
    echo(f"serve_peers_llm: building llama-server in {folder} (once: llama.cpp compiles "
         f"from source at nice 19 with -j {JOBS}, many minutes; output in {log})")
    began = time.monotonic()
    source = unpack_source(folder, log)
    llama = source / "vendor" / "llama.cpp"
    if not (llama / "tools" / "server" / "CMakeLists.txt").is_file():
        raise PeerError(f"{source.name}'s vendor/llama.cpp has no tools/server: this "
                        f"version carries no llama-server; pin an older {PACKAGE}")
    work = folder / "build"
    call(["nice", "-n", "19", "cmake", "-S", str(llama), "-B", str(work), *CMAKE_FLAGS],
         "cmake configure", log)
    call(["nice", "-n", "19", "cmake", "--build", str(work), "--target", *TARGETS,
          "-j", str(JOBS)], "cmake --build", log)
    (folder / "bin").mkdir()
    for target in TARGETS:
        built = work / "bin" / target
        if not built.is_file():
            raise PeerError(f"the build made no {built} (output in {log})")
        shutil.copy2(built, binary(folder, target))
    seconds = round(time.monotonic() - began, 1)
    version = call([str(binary(folder, "llama-server")), "--version"], "llama-server "
                   "--version", log)
    shutil.rmtree(work)
    shutil.rmtree(source)
    facts = {PACKAGE: source.name.rsplit("-", 1)[-1], "llama_server_version":
             _version_line(version + _last_stderr(log)), "cmake_flags": list(CMAKE_FLAGS),
             "jobs": JOBS, "build_s": seconds, "built": time.strftime("%Y-%m-%dT%H:%M:%S")}
    marker.write_text(json.dumps(facts))  # last: the build is finished
    echo(f"serve_peers_llm: llama-server built in {seconds:.0f} s")
    return facts


def unpack_source(folder: Path, log: Path) -> Path:
    """llama-cpp-python's source distribution downloaded into `folder` and unpacked; the
    unpacked folder."""
    download = folder / "sdist"
    call([sys.executable, "-m", "pip", "download", PACKAGE, "--no-binary", ":all:",
          "--no-deps", "-d", str(download)],
         f"pip download {PACKAGE}", log)
    archives = sorted(download.glob("*.tar.gz"))
    if not archives:
        raise PeerError(f"pip download {PACKAGE} gave no .tar.gz in {download}")
    with tarfile.open(archives[-1]) as archive:
        archive.extractall(folder, filter="data")
    shutil.rmtree(download)
    unpacked = folder / archives[-1].name.removesuffix(".tar.gz")
    if not unpacked.is_dir():
        raise PeerError(f"{archives[-1].name} did not unpack into {unpacked.name}")
    return unpacked


def _last_stderr(log: Path) -> str:
    """`llama-server --version` prints to stderr, which `call` wrote to the log only."""
    return log.read_text(errors="replace")[-2000:]


def _version_line(text: str) -> str | None:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("version:")]
    return lines[-1].removeprefix("version:").strip() if lines else None


def quantizer(folder: Path, log: Path) -> Callable[[Path, Path, str], None]:
    """`quantize(source, target, quant)` with the built `llama-quantize` (requantizing a
    quantized source, as llama_env.build_ggufs asks), for llama_env.build_ggufs."""
    def quantize(source: Path, target: Path, quant: str) -> None:
        call([str(binary(folder, "llama-quantize")), "--allow-requantize", str(source),
              str(target), quant, str(os.cpu_count() or 1)], f"llama-quantize to {quant}", log)

    return quantize


"""The servers of benchmarks/embedding/served.py: `compress serve` of a run's embedding
archive (`python -m compress serve RUN --engine torchserve|litserve --no-auth`, OpenAI's
route under `/predictions/MODEL/VERSION/v1`) and infinity-emb 0.0.78 in its own environment
(`infinity_emb v2 --model-id FOLDER --engine torch|optimum --device cpu`, under `/v1`).

infinity's variants, all on the same local model: `torch` (sentence-transformers on torch,
as infinity runs it), `torch-compile` (the same with `--compile`), `optimum` (ONNX Runtime on
sentence-transformers' fp32 ONNX export, which infinity optimizes itself) and `optimum-int8`
(ONNX Runtime on sentence-transformers' dynamic int8 file for this CPU, the one peers.py
times). The ONNX variants get folders of their own with exactly one .onnx
file each, at the top, and infinity is started in that folder with `--model-id .`: it picks
among several files by name (preferring "quantize" on a CPU), and given a folder's path it
hands optimum the file's absolute path, which optimum-onnx 0.1 refused. Each start gets an
empty Hugging Face cache: infinity writes its optimized ONNX there (`*_optimized.onnx`, with
optimum 1.26.1 in its environment, venvs.py) and serves that; `Server.optimization` says
whether the file was made, and when not, infinity's own line saying why.

Batch size and threads: compress's `--batch-size` and `--threads` (its archive's otherwise);
infinity's `--batch-size` (32 otherwise) and OMP_NUM_THREADS in its environment, which both
its engines honour (torch's intra-op threads, and ONNX Runtime's intra-op pool, whose size
follows OMP_NUM_THREADS in the 1.32 wheel; unset, each takes every core).

Cold start is from launching the command to the first answered embedding call (one every
quarter second); resident memory is sampled over the server's whole process tree
(benchmarks/harness/servers.py).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.embedding.served_load import probe
from benchmarks.harness.servers import RssSampler, wait_answered
from compress.serving.serve_folder import SERVER_INFO, free_ports, read_info
from compress.serving.server_process import stop

INFINITY_VARIANTS = ("torch", "torch-compile", "optimum", "optimum-int8")
SERVED_NAME = "all-MiniLM-L6-v2"  # the model name infinity serves under
OPTIMIZED_SUFFIX = "_optimized.onnx"  # infinity's name for the file it optimized
FAILED = re.compile(r"Optimization failed with (.*?)\.? Going to use the unoptimized model")


def optimization_outcome(made: list[str], log_text: str) -> str:
    """What became of infinity's ONNX optimization in one start: "optimized (FILE)" when it
    wrote its `*_optimized.onnx`, else "not optimized: " and its own reason from the log
    (its lines re-joined: its logger wraps them), or that the log gave none."""
    if made:
        return f"optimized ({made[0]})"
    found = FAILED.search(" ".join(log_text.split()))
    return ("not optimized: " + found.group(1)) if found else \
        "not optimized (infinity's log gives no reason)"


def infinity_folder(built: Path, onnx_file: str, out: Path) -> Path:
    """`out`: the built sentence-transformers folder's files and its `onnx_file` alone, at
    the top as `model.onnx` (fp32) or `model_quantized.onnx` (int8), hard-linked where the
    file system allows. Kept while it holds the same file."""
    name = "model_quantized.onnx" if "int8" in onnx_file else "model.onnx"
    target = out / name
    source = built / onnx_file
    if target.is_file() and target.stat().st_size == source.stat().st_size:
        return out
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(built, out, ignore=shutil.ignore_patterns("onnx", "*.onnx", "build.json",
                                                              "model.safetensors"))
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
    return out


def infinity_command(binary: Path, folder: Path, variant: str, port: int,
                     batch: int) -> list[str]:
    """infinity_emb v2's command line for `variant` on `folder` (an ONNX variant's is run in
    its folder: `--model-id .`)."""
    engine = "torch" if variant.startswith("torch") else "optimum"
    model = str(folder) if engine == "torch" else "."
    command = [str(binary), "v2", "--model-id", model, "--served-model-name", SERVED_NAME,
               "--engine", engine, "--device", "cpu", "--batch-size", str(batch),
               "--pooling-method", "mean", "--url-prefix", "/v1", "--host", "127.0.0.1",
               "--port", str(port), "--no-vector-disk-cache"]
    return command + (["--compile"] if variant == "torch-compile" else [])


class Server:
    """One server of a round: launched by `start`, answering at `base_url`, ended by `stop`.
    `spec`: {"key", "kind": "compress"|"infinity", and compress's "target", "engine",
    "model_name", "version", "serve_dir", or infinity's "binary", "folder", "variant"}.
    `batch`, `threads`: the server's batch size and intra-op threads (None: compress's
    archive's; infinity's batch 32 and every core)."""

    def __init__(self, spec: dict[str, Any], log_dir: Path, batch: int | None = None,
                 threads: int | None = None):
        self.spec, self.log_dir, self.batch, self.threads = spec, log_dir, batch, threads
        self.optimization: str | None = None  # an ONNX variant's, once stopped
        self.log_start = 0  # where this start's lines begin in the server's log
        self.port = free_ports(1)[0]
        self.process: subprocess.Popen | None = None
        self.sampler: RssSampler | None = None
        self.cache: Path | None = None  # infinity's Hugging Face cache, fresh each start
        self.launched = float("inf")
        prefix = (f"/predictions/{spec['model_name']}/{spec['version']}"
                  if spec["kind"] == "compress" else "")
        self.base_url = f"http://127.0.0.1:{self.port}{prefix}/v1"
        self.model = spec.get("model_name") or SERVED_NAME

    def command(self) -> list[str]:
        if self.spec["kind"] == "infinity":
            return infinity_command(Path(self.spec["binary"]), Path(self.spec["folder"]),
                                    self.spec["variant"], self.port, self.batch or 32)
        return [sys.executable, "-m", "compress", "serve", self.spec["target"], "--engine",
                self.spec["engine"], "--port", str(self.port), "--no-auth",
                *(["--batch-size", str(self.batch)] if self.batch else []),
                *(["--threads", str(self.threads)] if self.threads else [])]

    def start(self, timeout_s: float) -> float:
        """Launch the server and wait for its first answered call; the cold start in
        seconds. PeerError when it stops or never answers."""
        log_path = self.log_dir / f"{self.spec['key']}.log"
        self.log_start = log_path.stat().st_size if log_path.is_file() else 0
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
               "DO_NOT_TRACK": "1"}
        cwd = None
        if self.spec["kind"] == "infinity":
            self.cache = Path(tempfile.mkdtemp(prefix="serve_peers_embed_hf-"))
            env.update(HF_HUB_CACHE=str(self.cache), HF_HOME=str(self.cache))
            if self.threads:
                env["OMP_NUM_THREADS"] = str(self.threads)
            cwd = self.spec["folder"]
        self.launched = time.time()
        self.sampler = RssSampler(self._root)
        began = time.monotonic()
        try:
            with open(log_path, "ab") as log:
                self.process = subprocess.Popen(self.command(), stdout=log,
                                                stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                                start_new_session=True)
            # `compress serve` exits 0 once its worker is READY
            return wait_answered(self.process, self.ready,
                                 self.spec["key"], log_path, timeout_s, began,
                                 exits_when_ready=self.spec["kind"] == "compress")
        except BaseException:
            self.stop()
            raise

    def ready(self) -> str | None:
        """None once the server answers an embedding call, else what came back."""
        return probe(self.base_url, self.model, 60)

    def _root(self) -> int | None:
        """The server's pid: infinity's own, or the one `compress serve` recorded."""
        if self.spec["kind"] == "infinity":
            return self.process.pid if self.process else None
        serve_dir = Path(self.spec["serve_dir"])
        try:
            if (serve_dir / SERVER_INFO).stat().st_mtime < self.launched:
                return None  # a record of an earlier start
        except OSError:
            return None
        info = read_info(serve_dir)
        return int(info["pid"]) if info and info.get("pid") else None

    def _log_text(self) -> str:
        """This start's lines of the server's log."""
        try:
            with open(self.log_dir / f"{self.spec['key']}.log", "rb") as log:
                log.seek(self.log_start)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> int:
        """Stop the server and every process it started; the peak resident bytes seen."""
        peak = self.sampler.stop() if self.sampler else 0
        if self.process and self.process.poll() is None:
            group = self.process.pid  # its own session: the group holds what it started
            os.killpg(group, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(group, signal.SIGKILL)
                self.process.wait()
        if self.spec["kind"] == "compress":
            stop(Path(self.spec["serve_dir"]), echo=lambda _: None)
        if self.cache is not None:
            if self.spec.get("variant", "").startswith("optimum"):
                self.optimization = optimization_outcome(
                    sorted(p.name for p in self.cache.rglob(f"*{OPTIMIZED_SUFFIX}")),
                    self._log_text())
            shutil.rmtree(self.cache, ignore_errors=True)
            self.cache = None
        return peak

"""Starting, watching and stopping the servers of benchmarks/causal_lm/served.py: compress's
(`python -m compress serve TARGET --engine torchserve|litserve --no-auth`, with an empty
Inductor cache: `TORCHINDUCTOR_CACHE_DIR` a fresh temporary folder) and llama.cpp's
(`llama-server -m GGUF -np 8 -c <8 x cache_len> -t <cores>`), each on a free loopback port.

Cold start is the time from launching the command to the first answered request: a small
chat completion is sent every quarter second from the launch until one comes back 200.
Resident memory is sampled every half second over the server's whole process tree (the
pid `compress serve` records in `server.json`, or llama-server's, and every descendant:
TorchServe's Java frontend and its Python workers), and its maximum kept
(benchmarks/harness/servers.py).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.servers import RssSampler, wait_answered
from compress.serving.serve_folder import SERVER_INFO, free_ports, read_info
from compress.serving.serve_target import resolve_target
from compress.serving.server_process import stop

PROBE = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0,
         "stream": False}
SLOTS = 8  # llama-server's parallel sequences (-np), the continuous batch's rows


def probe(port: int, path: str, timeout_s: float, extra: dict[str, Any] | None = None
          ) -> str | None:
    """None when one small chat completion at `path` (with `extra` fields) is answered 200,
    else what came back (a status and the start of the body, or the connection's error)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=json.dumps({**PROBE, **(extra or {})}).encode(),
                     headers={"Content-Type": "application/json"})
        answer = conn.getresponse()
        body = answer.read()
        if answer.status == 200:
            return None
        return f"HTTP {answer.status}: {body[:160].decode('utf-8', errors='replace')}"
    except (OSError, http.client.HTTPException) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


class Server:
    """One server of a round: launched by `start`, answering at `url`, ended by `stop`."""

    def __init__(self, spec: dict[str, Any], log_dir: Path):
        self.spec, self.log_dir = spec, log_dir
        self.port = free_ports(1)[0]
        self.process: subprocess.Popen | None = None
        self.sampler: RssSampler | None = None
        self.inductor_dir: Path | None = None
        self.launched = float("inf")
        self.path = (spec["url_path"] if spec["engine"] == "llama-server" else
                     f"/predictions/{spec['model_name']}/{spec['version']}/v1/chat/completions")
        self.url = f"http://127.0.0.1:{self.port}{self.path}"
        self.serve_dir = (None if spec["engine"] == "llama-server" else
                          resolve_target(spec["target"]).serve_dir)

    def start(self, timeout_s: float) -> float:
        """Launch the server and wait for its first answered request; the cold start in
        seconds. PeerError (the server stopped) when it never answers."""
        log = open(self.log_dir / f"{self.spec['key']}.log", "ab")  # noqa: SIM115
        env = dict(os.environ)
        if self.spec["engine"] == "llama-server":
            command = [self.spec["binary"], "-m", self.spec["gguf"], "-np", str(SLOTS),
                       "-c", str(SLOTS * self.spec["cache_len"]), "-t", str(os.cpu_count() or 1),
                       "--host", "127.0.0.1", "--port", str(self.port)]
        else:
            self.inductor_dir = Path(tempfile.mkdtemp(prefix="serve_peers_inductor-"))
            env["TORCHINDUCTOR_CACHE_DIR"] = str(self.inductor_dir)
            command = [sys.executable, "-m", "compress", "serve", self.spec["target"],
                       "--engine", self.spec["engine"], "--port", str(self.port), "--no-auth",
                       "--timeout", str(int(timeout_s))]
        self.launched = time.time()
        self.sampler = RssSampler(self._root)
        began = time.monotonic()
        try:
            with log:
                self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                env=env, start_new_session=True)
            # `compress serve` exits 0 once it said READY
            cold = wait_answered(self.process, lambda: probe(self.port, self.path, timeout_s),
                                 self.spec["key"], Path(log.name), timeout_s, began,
                                 exits_when_ready=self.spec["engine"] != "llama-server")
            if self.spec["engine"] != "llama-server":
                self.process.wait(timeout=timeout_s)  # `compress serve` returns once READY
        except BaseException:
            self.stop()
            raise
        return cold

    def accepts(self, extra: dict[str, Any]) -> bool:
        """Whether the started server answers a request with the `extra` fields (an
        archive made before compress took `ignore_eos` refuses it with a 400)."""
        return probe(self.port, self.path, 120, extra) is None

    def _root(self) -> int | None:
        """The server's pid: llama-server's own, or the one `compress serve` recorded."""
        if self.spec["engine"] == "llama-server":
            return self.process.pid if self.process else None
        record = self.serve_dir / SERVER_INFO
        try:
            if record.stat().st_mtime < self.launched:  # a record of an earlier start
                return None
        except OSError:
            return None
        info = read_info(self.serve_dir)
        return int(info["pid"]) if info and info.get("pid") else None

    def stop(self) -> int:
        """Stop the server and every process it started; the peak resident bytes seen."""
        peak = self.sampler.stop() if self.sampler else 0
        if self.spec["engine"] == "llama-server":
            if self.process and self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        else:
            if self.process and self.process.poll() is None:  # still waiting for READY
                self.process.terminate()  # what it recorded is stopped below
                self.process.wait()
            stop(self.serve_dir, echo=lambda _: None)
        if self.inductor_dir is not None:
            shutil.rmtree(self.inductor_dir, ignore_errors=True)
            self.inductor_dir = None
        return peak

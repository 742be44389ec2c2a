"""Start the LitServe server of an unpacked archive in the background and wait until it
answers: what `compress serve --engine litserve` does after `serve_target.unpack_model`.

The serve folder holds the same files as TorchServe's (`model-store/MODEL/`, `logs/` with
`model_log.log`, `key_file.json` and `server.json`, both mode 0600), so `--stop`, `compress
loadtest` and the token command work alike; server.json says `"engine": "litserve"`.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from compress.errors import UserError
from compress.serving import server_process
from compress.serving.serve_folder import server_temp, write_keys
from compress.serving.serve_target import refuse_parallel_archive
from compress.serving.worker_log import WorkerLog
from compress.system import processes

ENGINE = "litserve"
MAIN = "compress.serving.litserve.main"  # in the server's command line (server_process)
INSTALL_HELP = ("LitServe is not installed: pip install -e '.[litserve]' (or pip install "
                "'litserve>=0.2.19')")


def check_installed() -> None:
    """LitServe is importable, or a UserError says how to install it."""
    if importlib.util.find_spec("litserve") is None:
        raise UserError(INSTALL_HELP)


def start(model_name: str, mar: Path, model_dir: Path, serve_dir: Path, port: int,
          settings: dict[str, Any], auth: bool, timeout_s: float,
          echo: Callable[[str], None]) -> dict[str, Any]:
    """Start the server of `model_dir` on 127.0.0.1:`port`; return server.json once it
    answers (on any failure it is stopped first)."""
    refuse_parallel_archive(mar, model_dir)
    token = secrets.token_urlsafe(24) if auth else None
    if token:
        write_keys(serve_dir, token)
    command = [sys.executable, "-m", MAIN, str(serve_dir), str(model_dir), str(port)]
    if not auth:
        command.append("--no-auth")
    temp = server_temp()
    env = {**os.environ, server_process.SERVE_DIR_ENV: str(serve_dir), "TMPDIR": str(temp)}
    with open(serve_dir / "logs" / "litserve.out", "wb") as out:
        process = subprocess.Popen(command, cwd=serve_dir, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    info = {"engine": ENGINE, "pid": process.pid, "pgid": process.pid,
            **server_process.identity(process.pid), "model_name": model_name,
            "mar": str(mar), "url": f"http://127.0.0.1:{port}/predictions/{model_name}",
            "port": port, "auth": auth, "model_api": False, "settings": settings,
            "serve_dir": str(serve_dir), "temp_dir": str(temp), "started": time.time()}
    return server_process.record_until_ready(
        serve_dir, info, lambda: wait_ready(info, serve_dir, timeout_s, echo),
        (lambda: token) if token else None)


def wait_ready(info: dict[str, Any], serve_dir: Path, timeout_s: float,
               echo: Callable[[str], None]) -> None:
    """Poll `/ping` until the server answers (it listens once a worker has loaded the
    model), echoing the handler's progress; a worker that fails to load is a UserError
    with its exception's last line."""
    url = f"http://127.0.0.1:{info['port']}/ping"
    deadline = time.monotonic() + timeout_s
    echo(f"waiting for LitServe to load {info['model_name']} (up to {timeout_s:.0f} s)")
    workers_log = WorkerLog(serve_dir / "logs" / "model_log.log")
    while time.monotonic() < deadline:
        for line in workers_log.read():
            echo(f"  {line}")
        if workers_log.deaths:
            raise UserError(workers_log.failure())
        if not processes.alive(info["pid"]):
            workers_log.read()
            raise UserError(workers_log.failure() if workers_log.deaths else
                            f"LitServe exited while starting: {_log_tail(serve_dir)}")
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise UserError(f"LitServe did not answer within {timeout_s:.0f} s: {_log_tail(serve_dir)}")


def _log_tail(serve_dir: Path, lines: int = 3) -> str:
    """The server's last error-looking lines, on one line."""
    out = serve_dir / "logs" / "litserve.out"
    text = out.read_text(errors="replace").splitlines() if out.is_file() else []
    errors = [line.strip() for line in text if "Error" in line or "ERROR" in line] or text
    return f"{' | '.join(errors[-lines:]) or 'no output'} (log: {out})"

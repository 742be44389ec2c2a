"""Deploy an unpacked archive on Ray Serve and wait until it answers: what `compress serve
--engine ray` does after `serve_target.unpack_model`.

It starts `compress.serving.ray.main` in the background (the process that starts a local
cluster when no `--address` is given, deploys the application, and removes what it started
when stopped), records it in server.json (`"engine": "ray"`) as LitServe's server is
recorded, so `--stop`, `compress loadtest` and the token command work alike, and waits
until every replica is up and `/ping` answers. The token stays in the serve folder's key
file (mode 0600); the cluster is given only its SHA-256."""

from __future__ import annotations

import importlib.util
import json
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
from compress.runfolder.files import atomic_write_json
from compress.serving import server_process
from compress.serving.handler_host.handler import MAX_REQUEST_SIZE, token_digest
from compress.serving.metrics_config import metrics_url
from compress.serving.ray.options import RayOptions
from compress.serving.serve_folder import server_temp, write_info, write_keys
from compress.serving.serve_target import refuse_parallel_archive
from compress.serving.worker_log import WorkerLog
from compress.system import processes

ENGINE = "ray"
MAIN = "compress.serving.ray.main"  # in the process's command line (server_process)
INSTALL_HELP = ("Ray Serve is not installed: pip install -e '.[ray]' (or pip install "
                "'ray[serve]>=2.50')")
OUT = "ray.out"


def check_installed() -> None:
    """Ray Serve is importable, or a UserError says how to install it."""
    if any(importlib.util.find_spec(name) is None for name in ("ray", "fastapi", "uvicorn")):
        raise UserError(INSTALL_HELP)


def start(model_name: str, mar: Path, model_dir: Path, serve_dir: Path, port: int,
          settings: dict[str, Any], auth: bool, timeout_s: float,
          echo: Callable[[str], None], options: RayOptions) -> dict[str, Any]:
    """Deploy `model_dir` on Ray Serve (its proxy on 127.0.0.1:`port` when compress starts
    Serve); return server.json once every replica is up (on any failure what was started
    is stopped first)."""
    from compress.serving.ray.main import PLAN

    refuse_parallel_archive(mar, model_dir)
    token = secrets.token_urlsafe(24) if auth else None
    if token:
        write_keys(serve_dir, token)
    atomic_write_json(serve_dir / PLAN, mode=0o600, data={
        "model_name": model_name, "options": options.record(),
        "digest": token_digest(token) if token else None,
        "max_request_size": MAX_REQUEST_SIZE,
        "batch_size": int(settings.get("continuous_rows") or settings["batchSize"] or 1),
        "threads": int(settings["threads_per_worker"] or 1)})
    command = [sys.executable, "-m", MAIN, str(serve_dir), str(model_dir), str(port)]
    temp = server_temp()
    env = {**os.environ, server_process.SERVE_DIR_ENV: str(serve_dir), "TMPDIR": str(temp)}
    with open(serve_dir / "logs" / OUT, "wb") as out:
        process = subprocess.Popen(command, cwd=serve_dir, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    info = {"engine": ENGINE, "pid": process.pid, "pgid": process.pid,
            **server_process.identity(process.pid), "model_name": model_name,
            "mar": str(mar), "url": f"http://127.0.0.1:{port}/predictions/{model_name}",
            "port": port, "auth": auth, "model_api": False,
            "settings": settings | {"replicas": options.replicas, "autoscale":
                                    list(options.autoscale) if options.autoscale else None},
            "ray": options.record(), "serve_dir": str(serve_dir), "temp_dir": str(temp),
            "started": time.time()}
    info = server_process.record_until_ready(
        serve_dir, info, lambda: wait_ready(info, serve_dir, timeout_s, echo),
        (lambda: token) if token else None)
    write_info(serve_dir, info)
    return info


def wait_ready(info: dict[str, Any], serve_dir: Path, timeout_s: float,
               echo: Callable[[str], None]) -> None:
    """Wait until the application runs (ray-state.json written) and `/ping` answers,
    echoing the handler's progress; `info` gets the cluster's address and the URL. A
    replica that fails to load, or a failure to start, is a UserError of one line."""
    from compress.serving.ray.main import STATE

    deadline = time.monotonic() + timeout_s
    echo(f"waiting for Ray Serve to load {info['model_name']} (up to {timeout_s:.0f} s)")
    workers_log = WorkerLog(serve_dir / "logs" / "model_log.log")
    state_file = serve_dir / STATE
    while time.monotonic() < deadline:
        for line in workers_log.read():
            echo(f"  {line}")
        if workers_log.deaths:
            raise UserError(workers_log.failure())
        if not processes.alive(info["pid"]):
            raise UserError(_failure(serve_dir))
        if state_file.is_file() and _answers(json.loads(state_file.read_text())):
            state = json.loads(state_file.read_text())
            info.update(url=state["url"], port=state["port"], ray_address=state["address"],
                        ray_app=state["app"], ray_cluster_started=bool(state["cluster"]),
                        ray_serve_started=state["serve_started"])
            if (state["cluster"] or {}).get("metrics_port"):  # a joined cluster's: its own
                info["metrics_url"] = metrics_url(state["cluster"]["metrics_port"])
            return
        time.sleep(0.3)
    raise UserError(f"Ray Serve did not answer within {timeout_s:.0f} s: {_failure(serve_dir)}")


def _answers(state: dict[str, Any]) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{state['port']}/ping",
                                    timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _failure(serve_dir: Path) -> str:
    """The keeper's one failure line, else its last error-looking lines, on one line."""
    from compress.serving.ray.main import FAILED

    out = serve_dir / "logs" / OUT
    text = out.read_text(errors="replace").splitlines() if out.is_file() else []
    failed = [line for line in text if line.startswith(FAILED)]
    if failed:
        return failed[-1]
    errors = [line.strip() for line in text if "Error" in line or "ERROR" in line] or text
    return f"{' | '.join(errors[-3:]) or 'no output'} (log: {out})"

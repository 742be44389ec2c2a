"""Start TorchServe on an unpacked archive in the background and wait until a worker of the
model is READY: what `compress serve` (`--engine torchserve`, the default) does after
`serve_target.unpack_model`.

The serve folder holds `config.properties` (every listener on 127.0.0.1, the inference port
the user's, the others free ones), `model-store/MODEL/`, `logs/` (`torchserve.out`,
`model_log.log`), `key_file.json` (tokens) and `server.json`. TorchServe's launcher writes
its pid file into the server's own TMPDIR (`serve_folder.server_temp`), and the frontend
its workers' Unix sockets (`.ts.sock.9000`, ...) into the same folder (its `TEMP`); a
launcher that leaves no pid file did not start, and its process group is killed before the
error is raised.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from compress.distributed.launch import LOCAL_TORCHRUN_ENV
from compress.errors import UserError
from compress.serving import server_process
from compress.serving.metrics_config import metrics_url, write_metrics_config
from compress.serving.serve_folder import (
    KEY_FILE,
    PID_FILE,
    free_ports,
    read_keys,
    remove_server_temp,
    server_temp,
)
from compress.serving.worker_log import WorkerLog
from compress.system import processes

ENGINE = "torchserve"
TOKEN_MINUTES = 60 * 24 * 30  # TorchServe's default (60) would expire tokens within the hour
# the Java frontend only relays requests and answers: its JIT at C1 (no C2 compiles beside
# the workers' threads), one compiler thread, the serial collector (no concurrent GC threads)
# and a heap of 64-512 MB, where the JVM's defaults take G1, two compiler threads and a
# quarter of the machine's memory
FRONTEND_VMARGS = ("-XX:+UseSerialGC", "-Xms64m", "-Xmx512m", "-XX:TieredStopAtLevel=1",
                   "-XX:CICompilerCount=1", "-XX:+ExitOnOutOfMemoryError")
JAVA_HELP = ("java not found: TorchServe needs Java 17; install it (Debian/Ubuntu: "
             "apt-get install openjdk-17-jre-headless) or set JAVA_HOME")


def check_installed() -> None:
    """TorchServe and Java 17 are installed, or a UserError says how to get them."""
    if importlib.util.find_spec("ts") is None:
        raise UserError("TorchServe is not installed: pip install -e '.[serve]' (torchserve, "
                        "torch-model-archiver, PyYAML)")
    java_home = os.environ.get("JAVA_HOME")
    java = Path(java_home) / "bin" / "java" if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise UserError(JAVA_HELP)


def start(model_name: str, mar: Path, model_dir: Path, serve_dir: Path, port: int,
          settings: dict[str, Any], auth: bool, model_api: bool, timeout_s: float,
          echo: Callable[[str], None]) -> dict[str, Any]:
    """Start TorchServe on `model_dir` (in its model store) on 127.0.0.1:`port`; return
    server.json once a worker is READY (on any failure it is stopped first)."""
    store = model_dir.parent
    if settings.get("maxBatchDelay") == 0:
        settings["maxBatchDelay"] = _no_zero_delay(model_dir, echo)
    management, metrics, grpc_i, grpc_m = free_ports(4, avoid={port})
    config = serve_dir / "config.properties"
    config.write_text("\n".join([
        f"inference_address=http://127.0.0.1:{port}",
        f"management_address=http://127.0.0.1:{management}",
        f"metrics_address=http://127.0.0.1:{metrics}",
        "grpc_inference_address=127.0.0.1", f"grpc_inference_port={grpc_i}",
        "grpc_management_address=127.0.0.1", f"grpc_management_port={grpc_m}",
        f"model_store={store}", f"token_expiration_min={TOKEN_MINUTES}",
        f"enable_model_api={'true' if model_api else 'false'}",
        "disable_system_metrics=true", "install_py_dep_per_model=false",
        "metrics_mode=prometheus", f"vmargs={' '.join(FRONTEND_VMARGS)}",
        f"metrics_config={write_metrics_config(serve_dir / 'metrics.yaml')}", ""]))
    command = [sys.executable, "-m", "ts.model_server", "--start", "--ncs", "--ts-config",
               str(config), "--model-store", str(store), "--models",
               f"{model_name}={model_name}"]
    if not auth:
        command.append("--disable-token-auth")
    if model_api:
        command.append("--enable-model-api")
    # TorchServe starts a tensor-parallel worker with `torchrun` from PATH: this Python's;
    # an inherited TS_CONFIG_FILE would replace `config` (addresses, auth): ours wins.
    # TEMP becomes the frontend's java.io.tmpdir (ts.model_server), where it names each
    # worker's Unix socket: Java ignores TMPDIR, and /tmp/.ts.sock.9000 is every server's
    temp = server_temp()
    env = {**os.environ, "TMPDIR": str(temp), "TEMP": str(temp),
           "LOG_LOCATION": str(serve_dir / "logs"),
           "TS_CONFIG_FILE": str(config), server_process.SERVE_DIR_ENV: str(serve_dir),
           "METRICS_LOCATION": str(serve_dir / "logs"),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                    os.environ.get("PATH", "")]),
           **LOCAL_TORCHRUN_ENV}
    with open(serve_dir / "logs" / "torchserve.out", "wb") as out:
        launcher = subprocess.Popen(command, cwd=serve_dir, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        launcher.wait(timeout=120)
    pid_file = temp / PID_FILE
    if not pid_file.is_file():  # what the launcher started goes too: nothing left running
        server_process.kill_group(launcher.pid)
        remove_server_temp(temp)
        raise UserError(f"TorchServe did not start: {_log_tail(serve_dir)}")
    pid = int(pid_file.read_text().split()[0])
    info = {"pid": pid, "pgid": launcher.pid, **server_process.identity(pid),
            "model_name": model_name, "mar": str(mar),
            "url": f"http://127.0.0.1:{port}/predictions/{model_name}",
            "port": port, "management_port": management, "metrics_port": metrics,
            "metrics_url": metrics_url(metrics),
            "auth": auth, "model_api": model_api, "settings": settings,
            "serve_dir": str(serve_dir), "temp_dir": str(temp), "started": time.time()}
    return server_process.record_until_ready(
        serve_dir, info, lambda: wait_ready(info, serve_dir, timeout_s, echo),
        (lambda: read_keys(serve_dir)["inference"]) if auth else None)


def wait_ready(info: dict[str, Any], serve_dir: Path, timeout_s: float,
               echo: Callable[[str], None]) -> None:
    """Poll the management API until a worker of the model is READY (not just /ping),
    echoing what the workers say they are doing; a second worker death while loading is
    a UserError with the exception's last line (TorchServe would restart it forever)."""
    url = f"http://127.0.0.1:{info['management_port']}/models/{info['model_name']}"
    deadline = time.monotonic() + timeout_s
    echo(f"waiting for a READY worker of {info['model_name']} (up to {timeout_s:.0f} s)")
    workers_log = WorkerLog(serve_dir / "logs" / "model_log.log")
    while time.monotonic() < deadline:
        if not processes.alive(info["pid"]):
            raise UserError(f"TorchServe exited while loading the model: {_log_tail(serve_dir)}")
        for line in workers_log.read():
            echo(f"  {line}")
        if workers_log.deaths >= 2:
            raise UserError(workers_log.failure())
        try:
            headers = {}
            if info["auth"] and (serve_dir / KEY_FILE).is_file():  # may be half-written yet
                headers["Authorization"] = f"Bearer {read_keys(serve_dir)['management']}"
            request = urllib.request.Request(url, headers=headers)
            with urllib.request.urlopen(request, timeout=5) as answer:
                described = json.loads(answer.read())
            workers = [w for m in described for w in m.get("workers", [])]
            if any(w.get("status") == "READY" for w in workers):
                return
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise UserError(f"no READY worker after {timeout_s:.0f} s: {_log_tail(serve_dir)}")


def _log_tail(serve_dir: Path, lines: int = 3) -> str:
    """The last error-looking lines of TorchServe's logs, on one line."""
    found: list[str] = []
    for log in (serve_dir / "logs").glob("*.log*"):
        found += [line.strip() for line in log.read_text(errors="replace").splitlines()
                  if "ERROR" in line or "Error" in line or "Exception" in line]
    out = serve_dir / "logs" / "torchserve.out"
    if not found and out.is_file():
        found = out.read_text(errors="replace").strip().splitlines()
    tail = " | ".join(found[-lines:]) or "no log output"
    return f"{tail} (logs in {serve_dir / 'logs'})"


def _no_zero_delay(model_dir: Path, echo: Callable[[str], None]) -> int:
    """TorchServe reads a maxBatchDelay of 0 as its default 100 ms (a lone request waited
    108 ms here): write 1 ms into the unpacked model-config.yaml instead; return it."""
    config_file = model_dir / "model-config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["maxBatchDelay"] = 1
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    echo("max batch delay 0 ms served as 1 ms: TorchServe reads 0 as its default 100 ms")
    return 1

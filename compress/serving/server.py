"""Start, wait for and stop a TorchServe (or LitServe: `engine="litserve"`, see
compress.serving.litserve) serving one compress `.mar`.

Each server lives in a serve folder (`<run>/serve/`, or `<name>.serve/` beside a bare
`.mar`): `config.properties`, the unpacked model with its batch settings, `logs/`,
TorchServe's pid file, `key_file.json` (tokens) and `server.json` (what `--stop` needs).
Every listener binds 127.0.0.1; only the inference port is chosen by the user.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from compress.distributed.launch import TORCHRUN_ENV
from compress.errors import UserError
from compress.serving import server_process
from compress.serving.litserve import launch as litserve_launch
from compress.serving.metrics_config import metrics_url, write_metrics_config
from compress.serving.openapi import write_openapi
from compress.serving.serve_folder import (  # noqa: F401 (the server's API)
    KEY_FILE,
    PID_FILE,
    SERVER_INFO,
    free_ports,
    port_in_use,
    process_alive,
    read_info,
    read_keys,
    record_server,
    registry_dir,
    remove_server_temp,
    server_temp,
    token_command,
    token_of,
    write_info,
)
from compress.serving.serve_target import (  # noqa: F401 (the server's API)
    MODEL_NAME,
    ServeTarget,
    resolve_target,
    unpack_model,
)
from compress.serving.server_process import stop, stop_servers  # noqa: F401 (the API)
from compress.serving.worker_log import WorkerLog

TOKEN_MINUTES = 60 * 24 * 30  # TorchServe's default (60) would expire tokens within the hour
JAVA_HELP = ("java not found: TorchServe needs Java 17; install it (Debian/Ubuntu: "
             "apt-get install openjdk-17-jre-headless) or set JAVA_HOME")
OPEN_MODEL_API = ("--no-auth with --enable-model-api would let any local process register "
                  "an archive whose handler runs code: keep the token, or the model API off")
ENGINES = ("torchserve", litserve_launch.ENGINE)  # the first is the default


def continuous_archive(mar: Path) -> bool:
    """Whether an archive's handler batches continuously (`asyncCommunication`: a causal
    LM whose requests join the running decode): grouping its requests would hold every
    answer of a group until the slowest, and fail them all together."""
    with zipfile.ZipFile(mar) as archive:
        if "model-config.yaml" not in archive.namelist():
            return False
        config = yaml.safe_load(archive.read("model-config.yaml")) or {}
    return bool(config.get("asyncCommunication"))


def start(target: ServeTarget, *, port: int = 8080, workers: int | None = None,
          batch_size: int | None = None, max_batch_delay_ms: int | None = None,
          threads: int | None = None, auth: bool = True, model_api: bool = False,
          timeout_s: float = 900,
          echo: Callable[[str], None] = print, engine: str = "torchserve") -> dict[str, Any]:
    """Start `engine` (TorchServe, or LitServe serving the same unpacked archive) on
    127.0.0.1:`port`, wait until a worker is ready; return server.json.

    Batch, worker and thread options override the archive's model-config.yaml. On any failure the
    server is stopped before the error is raised."""
    if engine not in ENGINES:
        raise UserError(f"unknown serving engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if not auth and model_api:
        raise UserError(OPEN_MODEL_API)
    if engine == litserve_launch.ENGINE:
        if model_api:
            raise UserError("--enable-model-api is TorchServe's management API: LitServe "
                            "serves the archive it starts with, and no other")
        litserve_launch.check_installed()
    else:
        check_prerequisites()
    running = read_info(target.serve_dir)
    if server_process.serving(running):
        raise UserError(f"{target.serve_dir.parent}: already served at {running['url']}; stop "
                        f"it first with: compress serve --stop {_shown(target)}")
    if port_in_use(port):
        raise UserError(f"port {port} on 127.0.0.1 is in use (another server?): choose "
                        f"another with --port, or stop what holds it")
    if batch_size not in (None, 1) and continuous_archive(target.mar):
        echo(f"--batch-size {batch_size} ignored: {target.model_name} batches continuously (each "
             f"request joins the running decode as it arrives: batch size 1 on every engine; "
             f"its decode rows are the package stage's batch_size)")
        batch_size = None
    serve_dir = target.serve_dir
    shutil.rmtree(serve_dir, ignore_errors=True)
    (serve_dir / "logs").mkdir(parents=True)
    store = serve_dir / "model-store"
    settings = unpack_model(target, store, workers, batch_size, max_batch_delay_ms, threads)
    write_openapi(store / target.model_name, serve_dir, target.model_name)
    if engine == litserve_launch.ENGINE:
        return litserve_launch.start(target.model_name, target.mar, store / target.model_name,
                                     serve_dir, port, settings, auth, timeout_s, echo)
    if settings.get("maxBatchDelay") == 0:
        settings["maxBatchDelay"] = _no_zero_delay(store / target.model_name, echo)
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
        "metrics_mode=prometheus",
        f"metrics_config={write_metrics_config(serve_dir / 'metrics.yaml')}", ""]))
    command = [sys.executable, "-m", "ts.model_server", "--start", "--ncs", "--ts-config",
               str(config), "--model-store", str(store), "--models",
               f"{target.model_name}={target.model_name}"]
    if not auth:
        command.append("--disable-token-auth")
    if model_api:
        command.append("--enable-model-api")
    # TorchServe starts a tensor-parallel worker with `torchrun` from PATH: this Python's;
    # an inherited TS_CONFIG_FILE would replace `config` (addresses, auth): ours wins
    temp = server_temp()
    env = {**os.environ, "TMPDIR": str(temp),
           "LOG_LOCATION": str(serve_dir / "logs"),
           "TS_CONFIG_FILE": str(config), server_process.SERVE_DIR_ENV: str(serve_dir),
           "METRICS_LOCATION": str(serve_dir / "logs"),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                    os.environ.get("PATH", "")]),
           **TORCHRUN_ENV}
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
            "model_name": target.model_name, "mar": str(target.mar),
            "url": f"http://127.0.0.1:{port}/predictions/{target.model_name}",
            "port": port, "management_port": management, "metrics_port": metrics,
            "metrics_url": metrics_url(metrics),
            "auth": auth, "model_api": model_api, "settings": settings,
            "serve_dir": str(serve_dir), "temp_dir": str(temp), "started": time.time()}
    record_server(serve_dir, info)
    try:
        wait_ready(info, serve_dir, timeout_s, echo)
    except BaseException:
        stop(serve_dir)
        raise
    if auth:
        info["token"] = read_keys(serve_dir)["inference"]
        write_info(serve_dir, info)
    return info


def check_prerequisites() -> None:
    """TorchServe and Java 17 are installed, or a UserError says how to get them."""
    import importlib.util

    if importlib.util.find_spec("ts") is None:
        raise UserError("TorchServe is not installed: pip install -e '.[serve]' (torchserve, "
                        "torch-model-archiver, PyYAML)")
    java_home = os.environ.get("JAVA_HOME")
    java = Path(java_home) / "bin" / "java" if java_home else shutil.which("java")
    if not java or not Path(java).exists():
        raise UserError(JAVA_HELP)


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
        if not process_alive(info["pid"]):
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


def curl_example(info: dict[str, Any], text: str = "a gripping, beautiful film") -> str:
    """A ready-to-paste curl command for the served model (a causal LM's streams: -N); the
    token comes from $TOKEN (`token_command`), never printed."""
    auth = '-H "Authorization: Bearer $TOKEN" ' if info.get("token") else ""
    if (info.get("settings") or {}).get("task") == "causal-lm":
        body = json.dumps({"prompt": "What is the capital of France?", "max_new_tokens": 32})
        return (f"curl -sN {auth}-H 'Content-Type: application/json' -d '{body}' "
                f"{info['url']}")
    body = json.dumps({"text": text})
    return (f"curl -s {auth}-H 'Content-Type: application/json' -d '{body}' "
            f"{info['url']}")


def served_task(run_dir: str | Path) -> str:
    """What the server of a run folder serves ("classification" when unknown)."""
    info = read_info(Path(run_dir) / "serve") or {}
    return (info.get("settings") or {}).get("task") or "classification"


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


def _shown(target: ServeTarget) -> str:
    return str(target.mar if target.serve_dir.suffix == ".serve" else target.serve_dir.parent)


def _no_zero_delay(model_dir: Path, echo: Callable[[str], None]) -> int:
    """TorchServe reads a maxBatchDelay of 0 as its default 100 ms (a lone request waited
    108 ms here): write 1 ms into the unpacked model-config.yaml instead; return it."""
    config_file = model_dir / "model-config.yaml"
    config = yaml.safe_load(config_file.read_text())
    config["maxBatchDelay"] = 1
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    echo("max batch delay 0 ms served as 1 ms: TorchServe reads 0 as its default 100 ms")
    return 1

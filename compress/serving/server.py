"""Start, wait for and stop a TorchServe (or LitServe: `engine="litserve"`, or Ray Serve:
`engine="ray"`) serving one compress `.mar`: `start` checks what is asked, unpacks the
archive, and hands it to the engine's launcher (compress.serving.torchserve.launch,
compress.serving.litserve.launch, compress.serving.ray.launch).

Each server lives in a serve folder (`<run>/serve/`, or `<name>.serve/` beside a bare
`.mar`): `config.properties`, the unpacked model with its batch settings, `logs/`,
`key_file.json` (tokens) and `server.json` (what `--stop` needs). Every listener binds
127.0.0.1; only the inference port is chosen by the user.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from compress.errors import UserError
from compress.serving import server_process
from compress.serving.litserve import launch as litserve_launch
from compress.serving.openapi import write_openapi
from compress.serving.ray import launch as ray_launch
from compress.serving.ray.options import RayOptions
from compress.serving.serve_folder import (  # noqa: F401 (the server's API)
    KEY_FILE,
    SERVER_INFO,
    free_ports,
    port_in_use,
    read_info,
    read_keys,
    registry_dir,
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
from compress.serving.torchserve import launch as torchserve_launch

OPEN_MODEL_API = ("--no-auth with --enable-model-api would let any local process register "
                  "an archive whose handler runs code: keep the token, or the model API off")
ENGINES = (torchserve_launch.ENGINE, litserve_launch.ENGINE, ray_launch.ENGINE)  # first: default


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
          echo: Callable[[str], None] = print, engine: str = "torchserve",
          ray: RayOptions | None = None) -> dict[str, Any]:
    """Start `engine` (TorchServe, or LitServe or Ray Serve serving the same unpacked
    archive) on 127.0.0.1:`port`, wait until a worker is ready; return server.json.

    Batch, worker and thread options override the archive's model-config.yaml; `ray`: the
    Ray engine's own (replicas, cluster). On any failure the server is stopped before the
    error is raised."""
    ray = ray or RayOptions()
    if engine not in ENGINES:
        raise UserError(f"unknown serving engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if engine != ray_launch.ENGINE and ray.given():
        raise UserError(f"{', '.join(ray.given())}: options of --engine ray, not of {engine}")
    if not auth and model_api:
        raise UserError(OPEN_MODEL_API)
    if engine in (litserve_launch.ENGINE, ray_launch.ENGINE) and model_api:
        shown = "LitServe" if engine == litserve_launch.ENGINE else "Ray Serve"
        raise UserError(f"--enable-model-api is TorchServe's management API: {shown} "
                        f"serves the archive it starts with, and no other")
    if engine == ray_launch.ENGINE:
        if workers is not None:
            raise UserError("--workers: Ray Serve runs replicas, not workers: use --replicas "
                            "N or --autoscale MIN,MAX")
        ray.check()
        ray_launch.check_installed()
        workers = ray.most_replicas()  # the cores are shared among the replicas' threads
    elif engine == litserve_launch.ENGINE:
        litserve_launch.check_installed()
    else:
        torchserve_launch.check_installed()
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
    if engine == ray_launch.ENGINE:
        return ray_launch.start(target.model_name, target.mar, store / target.model_name,
                                serve_dir, port, settings, auth, timeout_s, echo, ray)
    if engine == litserve_launch.ENGINE:
        return litserve_launch.start(target.model_name, target.mar, store / target.model_name,
                                     serve_dir, port, settings, auth, timeout_s, echo)
    return torchserve_launch.start(target.model_name, target.mar, store / target.model_name,
                                   serve_dir, port, settings, auth, model_api, timeout_s, echo)


def curl_example(info: dict[str, Any], text: str = "a gripping, beautiful film") -> str:
    """A ready-to-paste curl command for the served model (a causal LM's streams: -N); the
    token comes from $TOKEN (`token_command`), never printed."""
    auth = '-H "Authorization: Bearer $TOKEN" ' if info.get("token") else ""
    if (info.get("settings") or {}).get("task") == "causal-lm":
        body = json.dumps({"prompt": "What is the capital of France?", "max_new_tokens": 32})
        return (f"curl -sN {auth}-H 'Content-Type: application/json' -d '{body}' "
                f"{info['url']}")
    body = json.dumps({"text": text})
    if (info.get("settings") or {}).get("task") == "reranking":
        body = json.dumps({"query": "a gripping film", "documents": [text, "a dull movie"]})
    return (f"curl -s {auth}-H 'Content-Type: application/json' -d '{body}' "
            f"{info['url']}")


def served_task(run_dir: str | Path) -> str:
    """What the server of a run folder serves ("classification" when unknown)."""
    info = read_info(Path(run_dir) / "serve") or {}
    return (info.get("settings") or {}).get("task") or "classification"


def _shown(target: ServeTarget) -> str:
    return str(target.mar if target.serve_dir.suffix == ".serve" else target.serve_dir.parent)

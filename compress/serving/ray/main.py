"""The process `compress serve --engine ray` leaves running, as LitServe's server process:
`python -m compress.serving.ray.main SERVE_DIR MODEL_DIR PORT`, its plan in
SERVE_DIR/ray-plan.json (written by `launch`: the options, the token's digest, the limits).

It starts a local one-node cluster when no `address` is given (the head, in this process's
group: `cluster.start_node`), deploys the archive as a Ray Serve application (Serve started
with its proxy on 127.0.0.1:PORT, on the head only, when it does not run on the cluster
yet), writes SERVE_DIR/ray-state.json once every replica is up, and waits. On SIGTERM it
deletes its application, shuts Serve down if it started it and no other application is
left, and stops the local cluster if it started one: what it started, and only that. A
failure while starting is one line, `ray engine failed: ...`, in its log, read by
`launch`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from compress.serving.ray import cluster
from compress.serving.ray.application import app_name, bound
from compress.serving.ray.options import RayOptions, deployment_options

PLAN, STATE = "ray-plan.json", "ray-state.json"
FAILED = "ray engine failed: "  # the line `launch` reads when starting failed
UMASK = 0o077
CONTROLLER = ("SERVE_CONTROLLER_ACTOR", "serve")  # Ray Serve's controller: name, namespace
logger = logging.getLogger("compress.serving.ray")


class Stopped(Exception):
    """SIGTERM: stop what was started."""


def _stop(*_: object) -> None:
    raise Stopped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="compress.serving.ray.main")
    parser.add_argument("serve_dir", type=Path)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("port", type=int)
    args = parser.parse_args(argv)
    os.umask(UMASK)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(levelname)s] %(message)s")
    serve_dir, model_dir = args.serve_dir.resolve(), args.model_dir.resolve()
    plan = json.loads((serve_dir / PLAN).read_text())
    options = RayOptions.from_record(plan["options"])

    signal.signal(signal.SIGTERM, _stop)
    head: cluster.Node | None = None
    started: dict[str, Any] = {}
    try:
        address = options.address
        if address is None:
            logger.info("starting a local Ray cluster")
            head = cluster.start_node(serve_dir / "logs" / "ray-head.log", own_group=False,
                                      num_cpus=os.cpu_count())
            address = head.address
        state = deploy(address, serve_dir, model_dir, args.port, plan, options, started)
        signal.signal(signal.SIGTERM, _stop)  # ray.shutdown left SIGTERM at its default
        state["cluster"] = head.record() if head else None
        (serve_dir / STATE).write_text(json.dumps(state))
        logger.info("serving at %s with Ray Serve (%s)", state["url"], address)
        while True:
            signal.pause()
    except Stopped:
        logger.info("stopping")
    except Exception as exc:
        logger.exception("starting failed")
        print(f"{FAILED}{type(exc).__name__}: {_first_line(exc)}", flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup is not cut short
        if started:
            undeploy(started)
        if head is not None:
            cluster.stop_node(head.record())
        logger.info("stopped")


def deploy(address: str, serve_dir: Path, model_dir: Path, port: int, plan: dict[str, Any],
           options: RayOptions, started: dict[str, Any]) -> dict[str, Any]:
    """Deploy the archive on the cluster at `address`; `started` records what was started
    (as it is started, for `undeploy`); return ray-state.json."""
    import ray
    from ray import serve

    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False,
             configure_logging=False)
    signal.signal(signal.SIGTERM, _stop)  # ray.init sets its own, which exits at once
    started["address"] = address
    name = app_name(plan["model_name"])
    serve_ran = any((a["name"], a["namespace"]) == CONTROLLER
                    for a in ray.util.list_named_actors(all_namespaces=True))
    if serve_ran:
        from ray.serve.context import _connect

        running = _connect().get_serve_details().get("applications") or {}
        if name in running:
            raise RuntimeError(f"the cluster at {address} already serves an application "
                               f"named {name}: stop it first")
        taken = [a for a, details in running.items() if details.get("route_prefix") == "/"]
        if taken:
            raise RuntimeError(f"the cluster at {address} serves application {taken[0]} at "
                               f"route prefix /, which TorchServe's URLs (/ping, "
                               f"/predictions/...) need: one compress archive a Serve "
                               f"cluster; stop {taken[0]} or serve on another cluster")
    else:
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": cluster.LOOPBACK, "port": port})
        started["serve"] = True
    from ray.serve.context import _get_global_client

    port = _get_global_client().http_config.port
    application = bound(plan["model_name"], str(model_dir), str(serve_dir / "logs"),
                        plan["digest"], plan["max_request_size"],
                        deployment_options(options, plan["batch_size"], plan["threads"]))
    started["app"] = name
    try:
        serve.run(application, name=name, route_prefix="/", blocking=False)
    except RuntimeError as exc:
        raise RuntimeError(f"{_first_line(exc)} {_deployment_error(name)}".strip()) from exc
    ray.shutdown()
    return {"address": address, "app": name, "serve_started": bool(started.get("serve")),
            "port": port,
            "url": f"http://{cluster.LOOPBACK}:{port}/predictions/{plan['model_name']}"}


def undeploy(started: dict[str, Any]) -> None:
    """Delete the application, and Serve when this process started it and nothing else is
    deployed; each step logged, none stopping the next."""
    import ray
    from ray import serve

    try:
        if not ray.is_initialized():
            ray.init(address=started["address"], logging_level=logging.WARNING,
                     log_to_driver=False, configure_logging=False)
        if started.get("app"):
            serve.delete(started["app"])
        if started.get("serve") and not serve.status().applications:
            serve.shutdown()
    except Exception:
        logger.exception("could not remove the application %s", started.get("app"))
    finally:
        ray.shutdown()


def _deployment_error(name: str) -> str:
    """The last line of the error Ray Serve recorded for the application's deployment (the
    exception a replica's constructor raised), or ''."""
    from ray import serve

    try:
        app = serve.status().applications.get(name)
    except Exception:
        return ""
    messages = [d.message for d in (app.deployments.values() if app else ()) if d.message]
    lines = [line.strip() for m in messages for line in m.splitlines() if line.strip()]
    return f"({lines[-1][:300]})" if lines else ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:500] if text else "no message"


if __name__ == "__main__":
    main(sys.argv[1:])

"""The LitServe server process that `compress serve --engine litserve` starts in the
background: `python -m compress.serving.litserve.main SERVE_DIR MODEL_DIR PORT [--no-auth]`.

One uvicorn API server on 127.0.0.1:PORT and `maxWorkers` inference workers (LitServe's
processes, requests passed through its queues, answers through its ZeroMQ transport); the
token is read from the serve folder's key file (mode 0600), never from the command line.
It listens once a worker has loaded the model; SIGTERM shuts it down.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from compress.serving.litserve.routes import MAX_REQUEST_SIZE, http_error, ping
from compress.serving.serve_folder import read_keys

GRACE_S = 3  # seconds uvicorn waits for open connections when stopped


def build(serve_dir: Path, model_dir: Path, auth: bool):
    """The LitServer of the unpacked archive in `model_dir`."""
    import litserve as ls
    from starlette.exceptions import HTTPException

    from compress.serving.litserve.worker import HandlerAPI

    token = read_keys(serve_dir)["inference"] if auth else None
    api = HandlerAPI(model_dir, serve_dir / "logs", token, MAX_REQUEST_SIZE)
    workers = max(1, int(api.config.get("maxWorkers", 1)))
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=workers, timeout=False,
                          fast_queue=True, disable_openapi_url=True)
    server.uvicorn_graceful_timeout = GRACE_S
    server.app.add_exception_handler(HTTPException, http_error)
    server.app.add_api_route("/ping", ping, methods=["GET"])
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="compress.serving.litserve.main")
    parser.add_argument("serve_dir", type=Path)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("port", type=int)
    parser.add_argument("--no-auth", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s [%(levelname)s] %(message)s")
    server = build(args.serve_dir.resolve(), args.model_dir.resolve(), not args.no_auth)

    server_pid = os.getpid()

    def interrupt(*_: object) -> None:
        if os.getpid() != server_pid:  # a forked API server, already stopped by uvicorn
            raise SystemExit(0)
        raise KeyboardInterrupt  # LitServer.run shuts its processes down on it

    signal.signal(signal.SIGTERM, interrupt)
    server.run(host="127.0.0.1", port=args.port, num_api_servers=1, log_level="warning",
               generate_client_file=False, api_server_worker_type="process")


if __name__ == "__main__":
    main(sys.argv[1:])

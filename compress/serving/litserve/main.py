"""The LitServe server process that `compress serve --engine litserve` starts in the
background: `python -m compress.serving.litserve.main SERVE_DIR MODEL_DIR PORT [--no-auth]`.

One uvicorn API server on 127.0.0.1:PORT and `maxWorkers` inference workers (LitServe's
processes; requests, answers and cancels pass through queues of LitServe's
`multiprocessing` manager: a Unix socket in a private temporary folder, authenticated). The
process runs with umask 0o077, so every file and socket it or its workers make is private
to the user (LitServe's `fast_queue` would bind ZeroMQ sockets in /tmp: it stays off). The
token is read from the serve folder's key file (mode 0600), never from the command line.

A worker that dies is started again (after a pause that grows while it keeps dying, as
TorchServe's backoff); the API server ends the requests it held with a 503. The server
listens once a worker has loaded the model; SIGTERM shuts it down.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from compress.serving.handler_host.errors import http_error, unexpected_error
from compress.serving.handler_host.handler import MAX_REQUEST_SIZE
from compress.serving.litserve.routes import ping
from compress.serving.serve_folder import read_keys

GRACE_S = 3  # seconds uvicorn waits for open connections when stopped
UMASK = 0o077
MONITOR_S = 0.5  # how often LitServe's monitor looks for dead workers
BACKOFF_S = (0, 1, 2, 4, 8, 16, 32)  # pauses before restarts that follow each other
STEADY_S = 60.0  # a worker that lived this long restarts without a pause


class _NoWorker:
    """In place of a worker not restarted because the server is stopping."""

    pid, name = None, "not restarted"

    def is_alive(self) -> bool:
        return True

    def terminate(self) -> None:
        pass

    join = kill = terminate


def server_class() -> type:
    """LitServer with a cancel queue for each worker and a paced restart of dead workers."""
    import litserve as ls

    class Server(ls.LitServer):
        _restarts: list[float] = []
        _stopping = False

        def _perform_graceful_shutdown(self, *args: Any, **kwargs: Any) -> None:
            self._stopping = True  # the monitor restarts nothing from now on
            super()._perform_graceful_shutdown(*args, **kwargs)

        def _init_manager(self, num_api_servers: int) -> Any:
            manager = super()._init_manager(num_api_servers)
            for api in self.litapi_connector:
                count = len(self._inference_workers_config_for_api(api.api_path))
                api.loop.controls = api.spec.controls = [manager.Queue()
                                                         for _ in range(count)]
            return manager

        def launch_single_inference_worker(self, lit_api: Any, worker_id: int) -> Any:
            if self._stopping:
                return _NoWorker()
            now = time.monotonic()
            recent = [t for t in self._restarts if now - t < STEADY_S]
            pause = BACKOFF_S[min(len(recent), len(BACKOFF_S) - 1)]
            logging.getLogger(__name__).error(
                "worker %d died: restarting it in %d s", worker_id, pause)
            time.sleep(pause)
            self._restarts = [*recent, time.monotonic()]
            return super().launch_single_inference_worker(lit_api, worker_id)

    return Server


def build(serve_dir: Path, model_dir: Path, auth: bool):
    """The LitServer of the unpacked archive in `model_dir`."""
    from starlette.exceptions import HTTPException

    from compress.serving.litserve.worker import HandlerAPI

    token = read_keys(serve_dir)["inference"] if auth else None
    api = HandlerAPI(model_dir, serve_dir / "logs", token, MAX_REQUEST_SIZE)
    workers = max(1, int(api.config.get("maxWorkers", 1)))
    server = server_class()(api, accelerator="cpu", workers_per_device=workers, timeout=False,
                            fast_queue=False, disable_openapi_url=True, restart_workers=True)
    server.uvicorn_graceful_timeout = GRACE_S
    server.monitor_internal = MONITOR_S
    server.app.add_exception_handler(HTTPException, http_error)
    server.app.add_exception_handler(Exception, unexpected_error)
    server.app.add_api_route("/ping", ping, methods=["GET"])
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="compress.serving.litserve.main")
    parser.add_argument("serve_dir", type=Path)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("port", type=int)
    parser.add_argument("--no-auth", action="store_true")
    args = parser.parse_args(argv)
    os.umask(UMASK)  # before any file, socket or process: they all inherit it
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

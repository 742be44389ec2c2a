"""The Ray Serve deployment of one unpacked `.mar`: each replica (a Ray actor) imports the
archive's handler from the unpacked folder, as TorchServe does, calls its `initialize` with a
`HandlerContext`, and serves TorchServe's URLs (`routes`) through `runner.HandlerRunner`.

The folder is read at its path on the replica's node: on several machines the serve folder
must be at the same path on each (a shared filesystem). A replica writes the handler's
progress and failures to `logs/model_log.log` in TorchServe's format when that folder is
there, so `compress serve` reads them as it reads TorchServe's."""

from __future__ import annotations

import json
import logging
import traceback
import zlib
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import serve

from compress.serving.handler_host.context import HandlerContext
from compress.serving.handler_host.handler import (
    DIED,
    RESPONSE_TIMEOUT_S,
    load_handler,
    model_log,
)
from compress.serving.ray.routes import build_app
from compress.serving.ray.runner import HandlerRunner

SERVER_NAME = "Ray Serve"


@serve.deployment
@serve.ingress()
class HandlerReplica:
    """One replica serving the archive unpacked in `model_dir`."""

    def __init__(self, model_dir: str, logs: str | None, digest: str | None,
                 max_request_size: int) -> None:
        self.model_dir = Path(model_dir)
        config_file = self.model_dir / "model-config.yaml"
        self.config = (yaml.safe_load(config_file.read_text()) if config_file.is_file()
                       else None) or {}
        self.manifest = json.loads((self.model_dir / "MAR-INF/MANIFEST.json").read_text())
        self.model_name = self.manifest["model"]["modelName"]
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        worker = 9000 + zlib.crc32(self.replica.encode()) % 1000
        log = (model_log(Path(logs), self.model_name, worker) if logs and Path(logs).is_dir()
               else logging.getLogger())
        try:
            handler = load_handler(self.model_dir, self.manifest["model"]["handler"])
            handler.initialize(self.context())
        except Exception:
            for line in traceback.format_exc().splitlines():
                log.error(line)
            log.error(DIED)
            raise
        joining = bool(self.config.get("asyncCommunication"))
        self.runner = HandlerRunner(handler, self.context, joining,
                                    max(1, int(self.config.get("batchSize", 1))),
                                    int(self.config.get("maxBatchDelay", 100)) / 1000)
        self.routes = build_app(self.runner, self.model_name,
                             self.manifest["model"].get("modelVersion"), digest,
                             max_request_size,
                             float(self.config.get("responseTimeout") or RESPONSE_TIMEOUT_S),
                             self.replica, self.node)

    def context(self, request_ids: list[str] | None = None,
                headers: list[dict[str, Any]] | None = None, send=None) -> HandlerContext:
        return HandlerContext(self.model_name, self.model_dir, self.config, self.manifest,
                              request_ids, headers, send, server_name=SERVER_NAME)

    def __serve_build_asgi_app__(self) -> Any:
        return self.routes

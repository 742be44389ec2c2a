"""LitServe's API for one unpacked `.mar`, run in LitServe's inference worker.

`HandlerAPI.setup` imports the archive's handler file from the unpacked folder (the folder
first on `sys.path`, the one class the module defines, as TorchServe loads it) and calls its
`initialize` with a `HandlerContext`; its loop is `loop.HandlerLoop`. An `asyncCommunication`
(continuous-batching) handler gets one request a batch whatever `batchSize` says, so that
one request's failure or slowness is its own and each request's task can be cancelled alone.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from pathlib import Path
from typing import Any

import litserve as ls
import yaml
from fastapi import Request

from compress.serving.handler_host.context import HandlerContext
from compress.serving.handler_host.handler import (
    DIED,
    RESPONSE_TIMEOUT_S,
    check_token,
    load_handler,
    model_log,
)
from compress.serving.litserve.inflight import IDLE_GET_S
from compress.serving.litserve.loop import HandlerLoop
from compress.serving.litserve.routes import TorchServeRoutes

logger = logging.getLogger(__name__)


class HandlerAPI(ls.LitAPI):
    """The archive in `model_dir` (unpacked, its model-config.yaml final) as a LitAPI."""

    def __init__(self, model_dir: Path, logs: Path, token: str | None, max_request_size: int):
        self.model_dir, self.logs = Path(model_dir), Path(logs)
        config_file = self.model_dir / "model-config.yaml"
        self.config = (yaml.safe_load(config_file.read_text()) if config_file.is_file()
                       else None) or {}
        self.manifest = json.loads((self.model_dir / "MAR-INF/MANIFEST.json").read_text())
        self.model_name = self.manifest["model"]["modelName"]
        self.token = token
        self.joining = bool(self.config.get("asyncCommunication"))
        self.timeout_s = float(self.config.get("responseTimeout") or RESPONSE_TIMEOUT_S)
        routes = TorchServeRoutes(self.model_name, self.manifest["model"].get("modelVersion"),
                                  max_request_size, self.timeout_s)
        batch = 1 if self.joining else max(1, int(self.config.get("batchSize", 1)))
        super().__init__(max_batch_size=batch,
                         batch_timeout=int(self.config.get("maxBatchDelay", 100)) / 1000,
                         spec=routes, loop=HandlerLoop())
        routes.hold_s = max(IDLE_GET_S, self.batch_timeout) + 0.05
        routes.group_size = batch
        self.handler: Any = None

    def setup(self, device: str) -> None:
        """Import and initialize the handler; a failure is logged as TorchServe logs it."""
        log = model_log(self.logs, self.model_name,
                        9000 + int(os.environ.get("LITSERVE_WORKER_ID", "0")))
        try:
            self.handler = load_handler(self.model_dir, self.manifest["model"]["handler"])
            self.handler.initialize(self.context())
        except Exception:
            for line in traceback.format_exc().splitlines():
                log.error(line)
            log.error(DIED)
            raise

    def context(self, request_ids: list[str] | None = None,
                headers: list[dict[str, Any]] | None = None, send=None) -> HandlerContext:
        return HandlerContext(self.model_name, self.model_dir, self.config, self.manifest,
                              request_ids, headers, send)

    def authorize(self, request: Request) -> None:
        """TorchServe's token check: `Authorization: Bearer <token>` (when auth is on)."""
        check_token(request.headers.get("authorization", ""), self.token)

"""LitServe's API and loop for one unpacked `.mar`, run in LitServe's inference worker.

`HandlerAPI.setup` imports the archive's handler file from the unpacked folder (the folder
first on `sys.path`, the one class the module defines, as TorchServe loads it) and calls its
`initialize` with a `HandlerContext`. `HandlerLoop` replaces LitServe's decode / predict /
encode steps with the handler's own `handle`: it forms batches of up to `batchSize`
requests within `maxBatchDelay` ms (at once for an `asyncCommunication` handler, whose
`handle` returns a coroutine that runs on the worker's event loop thread while the next
requests arrive), and sends each streamed chunk and each answer back through LitServe's
transport as `(kind, status, headers, content type, bytes)`: kind "chunk" or "end".
"""

from __future__ import annotations

import asyncio
import hmac
import importlib
import inspect
import json
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from queue import Empty
from typing import Any

import litserve as ls
import yaml
from fastapi import HTTPException, Request
from litserve.loops.base import LitLoop
from litserve.utils import LitAPIStatus, LoopResponseType

from compress.serving.litserve.context import HandlerContext, Reply
from compress.serving.litserve.routes import TOKEN_FAILED, TorchServeRoutes, error_body

logger = logging.getLogger(__name__)
MODEL_LOG = "model_log.log"  # TorchServe's name and line format: WorkerLog reads both
DIED = "Backend worker process died."


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
        routes = TorchServeRoutes(self.model_name, self.manifest["model"].get("modelVersion"),
                                  max_request_size)
        super().__init__(max_batch_size=max(1, int(self.config.get("batchSize", 1))),
                         batch_timeout=int(self.config.get("maxBatchDelay", 100)) / 1000,
                         spec=routes, loop=HandlerLoop())
        self.handler: Any = None

    def setup(self, device: str) -> None:
        """Import and initialize the handler; a failure is logged as TorchServe logs it."""
        log = _model_log(self.logs, self.model_name)
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
        if self.token is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(),
                                                                 self.token.encode()):
            raise HTTPException(401, TOKEN_FAILED)


def load_handler(model_dir: Path, handler_file: str) -> Any:
    """An instance of the one class the archive's handler module defines."""
    sys.path.insert(0, str(model_dir))
    module = importlib.import_module(Path(handler_file).stem)
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
               if c.__module__ == module.__name__]
    if len(classes) != 1:
        raise ValueError(f"{handler_file} defines {len(classes)} classes: a handler module "
                         f"defines exactly one")
    return classes[0]()


class HandlerLoop(LitLoop):
    """Batches requests for the handler and sends its answers (see the module's doc)."""

    def __init__(self) -> None:
        super().__init__()
        self._transport: Any = None
        self._lock: threading.Lock | None = None  # made in the worker: a lock won't pickle
        self._events: asyncio.AbstractEventLoop | None = None

    def run(self, lit_api: HandlerAPI, device: str, worker_id: int, request_queue: Any,
            transport: Any, *_: Any) -> None:
        """One batch: wait for a request, gather more, hand them to the handler."""
        if self._lock is None:
            self._transport, self._lock = transport, threading.Lock()
            self._events = asyncio.new_event_loop()
            threading.Thread(target=self._events.run_forever, daemon=True,
                             name="handler-events").start()
        batch = [request_queue.get()]
        delay = 0.0 if lit_api.joining else lit_api.batch_timeout
        deadline = time.monotonic() + delay
        while len(batch) < lit_api.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                batch.append(request_queue.get(timeout=remaining) if remaining > 0
                             else request_queue.get_nowait())
            except Empty:
                break
        self._answer(lit_api, [(qid, uid) for qid, uid, _, _ in batch],
                     [payload for *_, payload in batch])

    def _answer(self, api: HandlerAPI, targets: list[tuple[int, str]],
                payloads: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        context = api.context([uid for _, uid in targets], [h for _, h in payloads],
                              lambda i, chunk: self._send(targets[i], "chunk",
                                                          context.replies[i], chunk))
        try:
            result = api.handler.handle([data for data, _ in payloads], context)
        except Exception as exc:
            self._fail(targets, exc)
            return
        if not inspect.isawaitable(result):
            self._finish(targets, context, result)
            return

        def done(future) -> None:
            if future.exception() is not None:
                self._fail(targets, future.exception())
            else:
                self._finish(targets, context, future.result())

        asyncio.run_coroutine_threadsafe(_awaited(result), self._events).add_done_callback(done)

    def _finish(self, targets: list[tuple[int, str]], context: HandlerContext,
                answers: Any) -> None:
        if not isinstance(answers, list) or len(answers) != len(targets):
            self._fail(targets, RuntimeError(f"the handler returned {type(answers).__name__} "
                                             f"for {len(targets)} requests, not a list of "
                                             f"one answer each"))
            return
        for target, reply, answer in zip(targets, context.replies, answers, strict=True):
            self._send(target, "end", reply, answer)

    def _fail(self, targets: list[tuple[int, str]], exc: BaseException) -> None:
        logger.error("prediction failed: %s", "".join(traceback.format_exception(exc)))
        reply = Reply(500, content_type="application/json")
        body = error_body(500, f"prediction failed: {type(exc).__name__}: {exc}")
        for target in targets:
            self._send(target, "end", reply, body)

    def _send(self, target: tuple[int, str], kind: str, reply: Reply, value: Any) -> None:
        status, headers, content_type = reply.head()
        message = (kind, status, headers, content_type, _as_bytes(value))
        with self._lock:
            self.put_response(self._transport, target[0], target[1], message,
                              LitAPIStatus.OK, LoopResponseType.STREAMING)


async def _awaited(result: Any) -> Any:
    return await result


def _as_bytes(value: Any) -> bytes:
    """An answer as TorchServe sends it: bytes as they are, text in UTF-8, else JSON."""
    if isinstance(value, bytes | bytearray):
        return bytes(value)
    return (value if isinstance(value, str) else json.dumps(value)).encode("utf-8")


def _model_log(logs: Path, model_name: str) -> logging.Logger:
    """The root logger writing `logs/model_log.log` in TorchServe's line format, so that
    `compress serve` reads the handler's progress and failures as it does TorchServe's."""
    worker = 9000 + int(os.environ.get("LITSERVE_WORKER_ID", "0"))
    handler = logging.FileHandler(logs / MODEL_LOG)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s [%(levelname)s] W-{worker}-{model_name}-stdout MODEL_LOG - %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return root

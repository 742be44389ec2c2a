"""LitServe's loop in the inference worker: the handler's own `handle` in place of LitServe's
decode / predict / encode steps.

It forms batches of up to `batchSize` requests within `maxBatchDelay` ms (at once, one
request a batch, for an `asyncCommunication` handler, whose `handle` returns a coroutine
that runs as a task on the worker's event loop thread while the next requests arrive), from
the groups of requests the API server queues (`routes.TorchServeRoutes._enqueue`: one get a
group; what does not fit the batch waits for the next). For each request it takes it first
sends "take" (its worker index and pid, so that the API server can tell when this process
dies), then each streamed chunk and the answer, through LitServe's transport as `(kind,
status, headers, content type, bytes)`: kind "chunk" or "end" (batched: every message
waiting when the transport is free goes in one, under the id `inflight.BATCH`). A request
id read from the worker's cancel queue cancels the task of its request (the handler cleans
up in its `finally`); a request cancelled or past `responseTimeout` before it was taken is
dropped. A failure answers a 500 with an error id; the traceback goes to the model log
under that id."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import threading
import time
from concurrent.futures import Future
from queue import Empty
from typing import Any

from litserve.loops.base import LitLoop
from litserve.utils import LitAPIStatus, LoopResponseType

from compress.serving.handler_host.context import HandlerContext, Reply
from compress.serving.handler_host.errors import internal_error
from compress.serving.handler_host.handler import answer_bytes
from compress.serving.litserve.inflight import BATCH, IDLE_GET_S, TAKE

logger = logging.getLogger(__name__)
EARLY_KEPT = 10_000  # cancelled ids not yet taken that a worker remembers
CONTROL_GET_S = 1.0  # the longest a worker waits on its cancel queue in one get


class HandlerLoop(LitLoop):
    """Batches requests for the handler and sends its answers (see the module's doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.controls: list[Any] | None = None  # each worker's cancel queue (main.Server)
        self._transport: Any = None
        self._lock: threading.Lock | None = None  # made in the worker: a lock won't pickle
        self._events: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[str, Future] = {}  # uid -> the task answering it
        self._outbox: list[tuple[int, str, tuple]] = []  # messages not sent yet
        self._ready: threading.Condition | None = None
        self._early: dict[str, float] = {}  # uid -> when it was cancelled, not yet taken
        self._backlog: list[tuple] = []  # requests got from the queue, not yet in a batch

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tasks": {}, "_early": {}, "_outbox": [], "_backlog": []}

    def run(self, lit_api: Any, device: str, worker_id: int, request_queue: Any,
            transport: Any, *_: Any) -> None:
        """One batch: wait for a request, gather more, hand them to the handler."""
        if self._lock is None:
            self._start(transport, worker_id)
        if not self._backlog:
            try:  # never a get without end: a worker killed in one loses what it returns
                self._backlog.extend(request_queue.get(timeout=IDLE_GET_S))
            except Empty:
                return
        delay = 0.0 if lit_api.joining else lit_api.batch_timeout
        deadline = time.monotonic() + delay
        while len(self._backlog) < lit_api.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                self._backlog.extend(request_queue.get(timeout=remaining) if remaining > 0
                                     else request_queue.get_nowait())
            except Empty:
                break
        size = lit_api.max_batch_size
        batch, self._backlog = self._backlog[:size], self._backlog[size:]
        batch = [item for item in batch if self._wanted(item, lit_api.timeout_s)]
        if not batch:
            return
        take = {"worker": str(worker_id or 0), "pid": str(os.getpid())}
        for qid, uid, _, _ in batch:
            self._send((qid, uid), TAKE, Reply(headers=take), b"")
        self._answer(lit_api, [(qid, uid) for qid, uid, _, _ in batch],
                     [payload for *_, payload in batch])

    def _start(self, transport: Any, worker_id: int | None) -> None:
        self._transport, self._lock = transport, threading.Lock()
        self._ready = threading.Condition()
        threading.Thread(target=self._flush, daemon=True, name="handler-answers").start()
        self._events = asyncio.new_event_loop()
        threading.Thread(target=self._events.run_forever, daemon=True,
                         name="handler-events").start()
        if self.controls:
            control = self.controls[(worker_id or 0) % len(self.controls)]
            threading.Thread(target=self._listen, args=(control,), daemon=True,
                             name="handler-cancels").start()

    def _wanted(self, item: tuple, timeout_s: float) -> bool:
        """Whether a request just taken is still waited for."""
        _, uid, queued, _ = item
        with self._lock:
            if self._early.pop(uid, None) is not None:
                return False
        return time.monotonic() - queued < timeout_s

    def _listen(self, control: Any) -> None:
        """Forever: cancel the task of each request id that comes on `control`."""
        while True:
            try:  # a bounded get: one left blocked by a dead worker would take a cancel
                uid = control.get(timeout=CONTROL_GET_S)
            except Empty:
                continue
            except (EOFError, OSError):  # the manager is gone: the server is stopping
                return
            with self._lock:
                future = self._tasks.pop(uid, None)
                if future is None:
                    self._early[uid] = time.monotonic()
                    while len(self._early) > EARLY_KEPT:
                        self._early.pop(next(iter(self._early)))
            if future is not None:
                future.cancel()  # cancels the task on the event loop thread

    def _answer(self, api: Any, targets: list[tuple[int, str]],
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

        def done(future: Future) -> None:
            with self._lock:
                for _, uid in targets:
                    self._tasks.pop(uid, None)
            if future.cancelled():
                return  # its client left or timed out: nobody waits for an answer
            if future.exception() is not None:
                self._fail(targets, future.exception())
            else:
                self._finish(targets, context, future.result())

        future = asyncio.run_coroutine_threadsafe(_awaited(result), self._events)
        if len(targets) == 1:  # a batch of several is not cancelled for one of them
            with self._lock:
                self._tasks[targets[0][1]] = future
        future.add_done_callback(done)

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
        body = internal_error("prediction failed", exc, logger)
        reply = Reply(500, content_type="application/json")
        for target in targets:
            self._send(target, "end", reply, body)

    def _send(self, target: tuple[int, str], kind: str, reply: Reply, value: Any) -> None:
        status, headers, content_type = reply.head()
        message = (kind, status, headers, content_type, answer_bytes(value))
        with self._ready:
            self._outbox.append((target[0], target[1], message))
            self._ready.notify()

    def _flush(self) -> None:
        """Forever: send every message waiting, one transport message per API server."""
        while True:
            with self._ready:
                while not self._outbox:
                    self._ready.wait()
                waiting, self._outbox = self._outbox, []
            by_server: dict[int, list[tuple[str, tuple]]] = {}
            for qid, uid, message in waiting:
                by_server.setdefault(qid, []).append((uid, message))
            for qid, items in by_server.items():
                self.put_response(self._transport, qid, BATCH, items, LitAPIStatus.OK,
                                  LoopResponseType.STREAMING)


async def _awaited(result: Any) -> Any:
    return await result

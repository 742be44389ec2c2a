"""The API server's side of the requests in flight: what each waits for, and how it ends
when the worker does not answer.

A request's entry in the response buffer is a `Pending`: the worker's messages queue on it
as LitServe delivers them. The worker's first message for a request is "take" (its worker
index and pid); `cancel` sends the request's id to that worker alone (before it, to every
worker). `messages` raises TimeoutError when the worker sends nothing for `timeout_s` (the
archive's responseTimeout, counted as TorchServe counts it: up to the first message, then
between messages).

The worker sends its messages in batches (all it has when the transport is free again: a
decode step's chunks of every stream in one message) under the id `BATCH`; `dispatch` hands
each to its request. LitServe's queue passes one message a round trip, so one message a
chunk fell behind the worker under many streams.

`watch` follows the server's inference workers (its spawned children) and, when one dies,
ends with a 503 the requests it took and those not yet taken that it may have been taking:
a worker killed inside the manager queue's `get` loses the requests that get returns (the
API server sends those it read in one pass of its loop as one group), and those it got but
had not yet batched, so every request sent before the death was seen, plus `hold_s` (the
longest get a worker makes: `IDLE_GET_S`, or the batch delay), is ended and cancelled."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from litserve.utils import LitAPIStatus, ResponseBufferItem

from compress.serving.handler_host.errors import error_body
from compress.system import processes

logger = logging.getLogger(__name__)
JSON = "application/json"
TAKE, CHUNK, END, FAIL = "take", "chunk", "end", "fail"  # FAIL: the engine's own error
BATCH = "compress-batch"  # the id under which a worker sends [(request id, message), ...]
WATCH_S = 0.25  # how often `watch` looks at the workers
IDLE_GET_S = 0.1  # the longest a worker waits on the request queue in one get
WORKER_MARK = "multiprocessing.spawn import spawn_main"  # LitServe's workers are spawned
Message = tuple[str, int, dict[str, str], str | None, bytes]


@dataclass
class Pending(ResponseBufferItem):
    """One request waiting on a worker: LitServe's buffer item, and who took it."""

    uid: str = ""
    worker: int | None = None
    pid: int | None = None
    ended: bool = False  # its last message came, or it was cancelled
    submitted: float = field(default_factory=time.monotonic)
    controls: list[Any] | None = field(default=None, repr=False)

    def cancel(self) -> None:
        """Tell the worker that holds it (any worker, before one took it) to drop it."""
        if self.ended:
            return
        self.ended = True
        queues = self.controls or []
        if self.worker is not None and self.worker < len(queues):
            queues = [queues[self.worker]]
        for control in queues:
            try:
                control.put(self.uid)
            except Exception:  # the manager is gone: the server is stopping
                logger.warning("could not cancel request %s", self.uid)


def failure(status: int, message: str) -> Message:
    """The engine's own error for a request, as a message."""
    return FAIL, status, {}, JSON, json.dumps(error_body(status, message)).encode()


async def messages(pending: Pending, timeout_s: float) -> AsyncIterator[Message]:
    """The worker's messages for `pending` up to its last ("end" or "fail")."""
    deadline = time.monotonic() + timeout_s
    while True:
        while not pending.response_queue:
            pending.event.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no answer within responseTimeout ({timeout_s:g} s)")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pending.event.wait(), remaining)
        message, status = pending.response_queue.popleft()
        if status == LitAPIStatus.ERROR:  # LitServe's own failure, not the handler's
            message = failure(500, "worker error")
        kind = message[0]
        if kind == TAKE:
            pending.worker, pending.pid = int(message[2]["worker"]), int(message[2]["pid"])
            continue
        deadline = time.monotonic() + timeout_s
        if kind in (END, FAIL):
            pending.ended = True
        yield message
        if kind in (END, FAIL):
            return


def dispatch_entry() -> ResponseBufferItem:
    """The response buffer's entry that receives the workers' batches."""
    return ResponseBufferItem(event=asyncio.Event(), response_queue=deque())


async def dispatch(buffer: dict[str, Any], entry: ResponseBufferItem) -> None:
    """Forever: hand each message of the workers' batches to its request."""
    while True:
        await entry.event.wait()
        entry.event.clear()
        while entry.response_queue:
            items, status = entry.response_queue.popleft()
            if status != LitAPIStatus.OK:
                continue
            for uid, message in items:
                pending = buffer.get(uid)
                if pending is not None:
                    pending.response_queue.append((message, LitAPIStatus.OK))
                    pending.event.set()


def worker_pids(parent: int) -> set[int]:
    """The live inference workers among the children of process `parent`."""
    return {pid for pid in processes.children(parent)
            if WORKER_MARK in processes.command_line(pid) and processes.alive(pid)}


def end(pending: Pending, status: int, message: str) -> None:
    """End `pending` with the engine's error (cancelled first where no worker took it)."""
    if pending.pid is None:
        pending.cancel()  # a copy still queued is dropped by the worker that takes it
    pending.ended, pending.pid = True, None
    pending.response_queue.append((failure(status, message), LitAPIStatus.OK))
    pending.event.set()


async def watch(buffer: dict[str, Any], hold_s: float) -> None:
    """Forever: end with a 503 each request that a dead worker held or may have been taking
    (LitServe restarts the worker)."""
    known: set[int] = set()
    died_at: float | None = None
    while True:
        await asyncio.sleep(WATCH_S)
        alive = worker_pids(os.getppid())
        dead, known = known - alive, alive
        if dead:
            died_at = time.monotonic()
            logger.error("worker process %s died", sorted(dead))
        for pending in list(buffer.values()):
            if not isinstance(pending, Pending) or pending.ended:
                continue
            if pending.pid is not None:
                lost = pending.pid in dead or not processes.alive(pending.pid)
            else:
                lost = died_at is not None and pending.submitted <= died_at + hold_s
            if lost:
                logger.error("request %s ended: its worker died", pending.uid)
                end(pending, 503, "the model's worker died while answering; it is being "
                                  "restarted")

"""How a replica runs the archive's handler: each request gets a queue of messages
(`(kind, status, headers, content type, bytes)`, kind "chunk", "end" or "fail", as LitServe's
worker sends them), filled from the handler's calls while the route reads it.

A handler without `asyncCommunication` gets batches of up to `batchSize` requests formed
within `maxBatchDelay` ms (Ray Serve's `serve.batch`), one `handle` call at a time on one
thread, as a TorchServe worker calls it. An `asyncCommunication` handler (continuous
batching) gets one request a call, at once; the coroutine its `handle` returns runs as a task
on the replica's handler event loop (a thread of its own, as in LitServe's worker), so that
each request's task is cancelled alone when its client leaves. A handler that raises answers
a 500 with an error id; the traceback goes to the log under that id."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from compress.serving.handler_host.context import HandlerContext, Reply
from compress.serving.handler_host.errors import internal_error
from compress.serving.handler_host.handler import answer_bytes

logger = logging.getLogger(__name__)
CHUNK, END, FAIL = "chunk", "end", "fail"  # FAIL: the handler raised
Message = tuple[str, int, dict[str, str], str | None, bytes]


@dataclass
class Call:
    """One request on its way through the handler."""

    uid: str
    data: dict[str, Any]
    headers: dict[str, Any]
    messages: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: Future | None = None  # an asyncCommunication handler's task for it

    def cancel(self) -> None:
        """Its client left or it timed out: stop its task (a batch's call runs on)."""
        if self.task is not None:
            self.task.cancel()


class HandlerRunner:
    """Hands calls to the handler (see the module's doc)."""

    def __init__(self, handler: Any, context: Any, joining: bool, batch_size: int,
                 batch_delay_s: float) -> None:
        self.handler, self.context, self.joining = handler, context, joining
        self._calls = ThreadPoolExecutor(1, thread_name_prefix="handler-calls")
        self._events = asyncio.new_event_loop()
        threading.Thread(target=self._events.run_forever, daemon=True,
                         name="handler-events").start()
        self._batched.set_max_batch_size(1 if joining else batch_size)
        self._batched.set_batch_wait_timeout_s(0.0 if joining else batch_delay_s)

    def submit(self, call: Call) -> asyncio.Future:
        """Start answering `call` (its messages come on `call.messages`)."""
        if self.joining:
            return asyncio.ensure_future(self._run([call]))
        return asyncio.ensure_future(self._batched(call))

    @serve.batch(max_batch_size=1, batch_wait_timeout_s=0.0)
    async def _batched(self, calls: list[Call]) -> list[None]:
        await self._run(calls)
        return [None] * len(calls)

    async def _run(self, calls: list[Call]) -> None:
        """One `handle` call for `calls`; every call ends with its "end" message."""
        loop = asyncio.get_running_loop()

        def send(call: Call, kind: str, reply: Reply, value: Any) -> None:
            status, headers, media = reply.head()
            message = (kind, status, headers, media, answer_bytes(value))
            loop.call_soon_threadsafe(call.messages.put_nowait, message)

        context: HandlerContext = self.context(
            [c.uid for c in calls], [c.headers for c in calls],
            lambda i, chunk: send(calls[i], CHUNK, context.replies[i], chunk))
        try:
            result = await loop.run_in_executor(
                self._calls, self.handler.handle, [c.data for c in calls], context)
            if inspect.isawaitable(result):
                task = asyncio.run_coroutine_threadsafe(_awaited(result), self._events)
                if len(calls) == 1:
                    calls[0].task = task
                result = await asyncio.wrap_future(task)
        except asyncio.CancelledError:
            return  # its client left or it timed out: nobody waits for an answer
        except Exception as exc:
            _fail(calls, exc, send)
            return
        if not isinstance(result, list) or len(result) != len(calls):
            _fail(calls, RuntimeError(f"the handler returned {type(result).__name__} for "
                                      f"{len(calls)} requests, not a list of one answer "
                                      f"each"), send)
            return
        for call, reply, answer in zip(calls, context.replies, result, strict=True):
            send(call, END, reply, answer)


def _fail(calls: list[Call], exc: BaseException, send: Any) -> None:
    body = internal_error("prediction failed", exc, logger)
    for call in calls:
        send(call, FAIL, Reply(500, content_type="application/json"), body)


async def _awaited(result: Any) -> Any:
    return await result

"""compress's TorchServe handler for causal LMs: each request joins the continuous batch
(`batcher.py`; `choices.py` follows its rows to the answer), or, on a parallel worker, one
batched decode per TorchServe batch; every request's tokens streamed as they are produced.

Packed into a causal-LM `.mar` by the package stage as `serve/causal_lm/server/`, beside the
runtime it decodes with; imports nothing from compress. `model-config.yaml`'s
`handler:` section holds threads, max_new_tokens, default_new_tokens, cache_len, compile,
chat_template, and with continuous batching rows and max_waiting (past it a request gets
503 + Retry-After). Requests and answers: `requests.py` (native NDJSON), `openai.py`
(OpenAI's routes). A bad request gets a 400 for it alone; every answer carries
`X-Batch-Size`. On the batch path the rows of a batch are left-padded into one decode at
the next bucket size (1, 2, 4, ... up to batchSize), each compiled once as the worker
starts.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from ts.torch_handler.base_handler import BaseHandler

from serve import worker_imports
from serve.handler_settings import HandlerSettings
from serve.http_answers import request_content_type
from serve.worker_clock import stamped
from serve.worker_memory import return_freed_memory
from serve.worker_threads import worker_threads

from ..runtime import expert_parallel, grouped, loading, pipeline, tensor_parallel
from . import (
    batcher,
    choices,
    compiled_graphs,
    grammar,
    prefill,
    replies,
    requests,
    speculation,
)
from . import openai as openai_routes

logger = logging.getLogger(__name__)
QUEUE_FULL = getattr(batcher, "QueueFull", ())  # the batcher's full queue: a 503
BATCH_HEADER = replies.BATCH_HEADER
PROGRESS = "compress worker: "  # what `compress serve` echoes while the worker starts


class CausalLMHandler(BaseHandler):
    """Loads a causal-LM folder and answers each TorchServe batch with one decode."""

    def initialize(self, context) -> None:
        """Load the model, set threads, build (and compile) one decoder per bucket. With
        continuous batching all of it runs on the thread that then decodes (`_torch_thread`)."""
        config = context.model_yaml_config or {}
        # TorchServe starts a `parallelType: tp` worker as one torchrun job: every rank gets
        # every request, decodes its share of each layer, and rank 0 answers
        self.ranks = int(os.environ.get("WORLD_SIZE", "1"))
        # asyncCommunication: each request reaches `handle` as it arrives and joins the
        # running decode (batcher); otherwise one decode per TorchServe batch
        self.continuous = bool(config.get("asyncCommunication")) and self.ranks == 1
        self.model_name = context.model_name
        self.batcher = None
        if self.continuous:
            replies.guard_async_worker_socket()
            replies.drop_raw_bodies()
            self._torch_thread(context)
        else:
            self._prepare(context)
        self.initialized = True

    def _torch_thread(self, context) -> None:
        """Prepare the model on a thread of its own, which then runs the continuous batch.
        One thread does all of the worker's torch work: a second thread's OpenMP team beside
        the first's made every parallel region 2-3x slower (libgomp throttles its spinning
        when it manages more threads than cores; measured: 101 -> 40 tok/s decoding)."""
        ready, failed = threading.Event(), []

        def run() -> None:
            try:
                self._prepare(context)
            except BaseException as exc:  # noqa: BLE001 (raised again by initialize)
                failed.append(exc)
                return
            finally:
                ready.set()
            self.batcher.serve()

        threading.Thread(target=run, name="compress-torch", daemon=True).start()
        ready.wait()
        if failed:
            raise failed[0]

    def _prepare(self, context) -> None:
        """Load, split across ranks, build and warm up the decoders (and the batcher)."""
        model_dir = Path(context.system_properties["model_dir"])
        config = context.model_yaml_config or {}
        settings = HandlerSettings.from_config(config.get("handler"))
        torch.set_num_threads(worker_threads(settings.threads,
                                             int(config.get("maxWorkers", 1)) * self.ranks))
        logger.info("%s%s", PROGRESS, stamped(f"loading {model_dir.name}"))
        worker_imports.leave_out(worker_imports.UNUSED + (
            () if loading.needs_torchao(model_dir) else ("torchao",)))
        # one process: each weight's state dict copy goes as its records are made
        self.causal_lm = loading.load_folder(model_dir, held_once=self.ranks == 1)
        logger.info("%s%s", PROGRESS, stamped("tokenizer and weights loaded"))
        self.pipe = None  # `parallelType: pp`: this rank's pipeline stage, decoded through
        # by every rank in step; or, with expert_parallel, this rank's experts, rank 0 leading
        self.leads = self.ranks > 1 and bool(settings.expert_parallel)
        if self.leads:  # the ranks meet in a FileStore in the model folder, on loopback
            expert_parallel.join_and_split(self.causal_lm.model, model_dir)
        elif self.ranks > 1 and config.get("parallelType") == "pp":
            self.pipe = pipeline.join_and_split(self.causal_lm.model, model_dir)
        elif self.ranks > 1:
            tensor_parallel.join_and_split(self.causal_lm.model, model_dir)
        self.stop = loading.stop_ids(self.causal_lm.model, self.causal_lm.tokenizer)
        cache_len = settings.cache_len
        self.limits = requests.Limits(
            settings.max_new_tokens, settings.default_new_tokens, cache_len,
            settings.chat_template,
            requests.prompt_chars_bound(self.causal_lm.tokenizer, cache_len),
            settings.max_schema_chars, vocab=int(self.causal_lm.model.config.vocab_size))
        mode = settings.compile if self.ranks == 1 else "none"
        steps: dict[int, Any] = {}  # decode steps compiled ahead of time, shipped
        shipped_prefill = None  # and the prefill, where shipped
        shipped_verify: dict[int, Any] = {}  # and speculation's verification
        if mode != "none":
            steps, shipped_prefill, said = compiled_graphs.use_shipped(
                model_dir / compiled_graphs.FOLDER, self.causal_lm.model, settings)
            if steps and settings.speculate:
                shipped_verify = compiled_graphs.use_shipped_verify(
                    model_dir / compiled_graphs.FOLDER, self.causal_lm.model)
            logger.info("%s%s", PROGRESS, stamped(said))
        # the kernel records are all a served model reads: the state dict's copy of each
        # weight goes, and the memory loading freed goes back to the system
        released = self.causal_lm.released + grouped.release_sources(self.causal_lm.model)
        return_freed_memory()
        logger.info("%s%s", PROGRESS, stamped(
            f"weights held once ({released} modules' state dict copies dropped)"))
        batch_size = int(config.get("batchSize", 1))
        rows = settings.rows_of(batch_size) if self.continuous else batch_size
        # micro-batches: one a rank where the rows divide; rank 0 alone gets the requests
        # and leads every generation
        make = (lambda: pipeline.PipelineDecoder(self.pipe, cache_len, self.ranks,
                                                 lead=True)) if self.pipe else None
        if self.leads:
            make = expert_parallel.leading_decoders(self.causal_lm.model, cache_len)
        self.decoders = compiled_graphs.build_decoders(self.causal_lm.model, batcher.buckets(rows),
                                                       cache_len, mode, settings.cpp_wrapper,
                                                       make, steps)
        compiled_graphs.warm_up(self.decoders, self.continuous,
                                lambda line: logger.info("%s%s", PROGRESS, stamped(line)))
        if self.pipe is not None and self.pipe.rank > 0:  # its requests come through rank 0
            pipeline.follow(self.decoders[max(self.decoders)])
        if self.leads and torch.distributed.get_rank() > 0:  # so do an expert rank's
            expert_parallel.follow(self.decoders)
        if self.continuous:  # its loop runs on this thread (`_torch_thread`)
            prefiller = prefill.prefiller_of(self.causal_lm.model, settings, self.limits.cache_len,
                                             shipped_prefill)
            verify = speculation.verifier(self.causal_lm.model, self.decoders,
                                          settings.speculate, shipped_verify)
            self.batcher = batcher.ContinuousBatcher(
                self.decoders, prefiller, self.stop, own_thread=False,
                max_waiting=settings.max_waiting, speculate=settings.speculate, verify=verify)
            prefiller.warm_up()
            logger.info("%s%s", PROGRESS, stamped(f"prefill ({prefiller.kind}) warmed up"))
            self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")  # off the loop
            self.compiling = grammar.CompileQueue(settings.max_schema_waiting)  # beside it
        logger.info("compress LM handler: %s, %d threads, buckets %s, compile %s, %d rank(s)",
                    self.causal_lm.facts.get("scheme") or self.causal_lm.facts.get("dtype"),
                    torch.get_num_threads(), list(self.decoders), mode, self.ranks)

    def encode(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """Token ids of a prompt or chat messages."""
        chat = isinstance(prompt, list) or self.limits.chat_template
        return loading.prompt_ids(self.causal_lm.tokenizer, prompt, chat)

    def handle(self, data: list[dict[str, Any]], context) -> Any:
        """Answer the requests: with continuous batching a coroutine that TorchServe's
        asynchronous worker awaits (each request joins the running decode), else the batch's
        answers, the good requests decoded together."""
        if self.batcher is not None:
            return self._handle_joining(data, context)
        return self._handle_batch(data, context)

    async def _handle_joining(self, data: list[dict[str, Any]], context) -> list[str]:
        answers = await asyncio.gather(*(self._answer(i, request, context)
                                         for i, request in enumerate(data)),
                                       return_exceptions=True)
        return [a if isinstance(a, str) else replies.failed(context, i, a, openai=False)
                for i, a in enumerate(answers)]  # an unexpected failure: that request's 500

    async def _answer(self, i: int, request: dict[str, Any], context) -> str:
        """One request through the continuous batch: its chunks sent as they come (native
        NDJSON, or OpenAI's server-sent events on its routes); its last answer returned.
        `X-Batch-Size`: the rows decoding when its first token came, itself included (or when
        it arrived, for a refusal).
        Its row is cancelled however the request ends (an answer, an error, a stop string,
        its coroutine cancelled because its client left)."""
        context.set_response_header(i, BATCH_HEADER, str(self.batcher.busy()))
        began = time.perf_counter()
        try:
            route = openai_routes.route_of(context.get_request_header(i, "url_path"))
        except openai_routes.RouteError as exc:
            return replies.error(context, i, str(exc), 404, openai=True)
        if route == openai_routes.MODELS:
            context.set_response_content_type(i, "application/json")
            return json.dumps(openai_routes.models(self.model_name))
        encode = self.encode if route != openai_routes.COMPLETIONS else self.encode_raw
        try:  # counted from its arrival: past the queue's bound, refused before its body
            # is parsed (each request's body, up to the request limit, waits for the parse)
            self.batcher.arrive()
        except QUEUE_FULL as exc:
            request.clear()
            return replies.queue_full(context, i, str(exc), exc.retry_after_s,
                                      openai=route is not None)
        try:  # off the event loop: a body of up to the request limit, a chat template; a
            # grammar on a thread of its own (compiled once a schema, its tokenizer view once
            # a worker), so that plain prompts keep flowing while it compiles
            prompts, wanted = await asyncio.get_running_loop().run_in_executor(
                self.tokenizing, choices.parse_choices, request, route, encode, self.limits,
                request_content_type(context, i, request))
            constraints = [c for one in prompts for c in await choices.constraints_of(
                one, self.causal_lm.tokenizer, self.compiling)]
        except ValueError as exc:
            return replies.error(context, i, str(exc), 400, openai=route is not None)
        except QUEUE_FULL as exc:  # schemas waiting to compile, past the bound
            return replies.queue_full(context, i, str(exc), exc.retry_after_s,
                                      openai=route is not None)
        except Exception as exc:  # noqa: BLE001 (a bug: this request's 500, in its route's shape)
            return replies.failed(context, i, exc, openai=route is not None)
        finally:
            request.clear()  # only the parsed request is kept (the engine holds `request`)
            self.batcher.depart()  # submitted below with no await between: always counted
        answer = (openai_routes.Answer(route, self.model_name, wanted, self.token_text)
                  if route else None)
        parsed = prompts[0]  # what a request's prompts share: stream, n, stop, ...
        context.set_response_content_type(
            i, (openai_routes.STREAM_TYPE if answer else replies.STREAM_TYPE)
            if parsed.stream else "application/json")
        loop = asyncio.get_running_loop()
        echo = wanted is not None and wanted.echo
        runs = [choices.row_run(k, one, loop, constraints[index], self.causal_lm.tokenizer,
                                index, echo)
                for index, (one, k) in enumerate((one, k) for one in prompts
                                                 for k in range(one.n))]
        try:
            self.batcher.submit_all([run.row for run in runs])
        except QUEUE_FULL as exc:
            return replies.queue_full(context, i, str(exc), exc.retry_after_s,
                                      openai=answer is not None)
        try:
            return await choices.answer_rows(context, i, self.batcher, runs, prompts, answer,
                                             began)
        except Exception as exc:  # noqa: BLE001 (a failed send, say: this request alone)
            return replies.failed(context, i, exc, openai=answer is not None,
                                  streamed=parsed.stream and any(r.stream.sent
                                                                 for r in runs))
        finally:
            for run in runs:
                self.batcher.cancel(run.row)

    def token_text(self, token: int) -> str:
        """A token's text, as log-probabilities name it."""
        return self.causal_lm.tokenizer.decode([token])

    def encode_raw(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """Token ids of a prompt as it is (OpenAI's completions: no chat template)."""
        return loading.prompt_ids(self.causal_lm.tokenizer, prompt, isinstance(prompt, list))

    def _handle_batch(self, data: list[dict[str, Any]], context) -> list[str]:
        """Answer every request of the batch: the good ones decoded together, streamed."""
        results: list[Any] = [None] * len(data)
        parsed: dict[int, requests.GenerationRequest] = {}
        for i, request in enumerate(data):
            context.set_response_header(i, BATCH_HEADER, str(len(data)))
            path = (context.get_request_header(i, "url_path") or "").strip("/")
            try:  # OpenAI's routes are the continuous batch's: an OpenAI 404 here
                if path:
                    raise LookupError(f"unknown path {path!r}: this model answers POST "
                                      f"/predictions/{self.model_name} only")
                one = requests.parse(requests.read_body(
                    request, request_content_type(context, i, request)), self.encode,
                    self.limits)
                if one.ignore_eos or one.n > 1 or one.logprobs is not None or one.json_schema:
                    raise ValueError("ignore_eos, n, logprobs and json_schema: only on a "
                                     "continuous-batching archive")
                parsed[i] = one
            except (ValueError, LookupError) as exc:
                results[i] = json.loads(replies.error(context, i, str(exc),
                                                      404 if path else 400, bool(path)))
                continue
            context.set_response_content_type(i, replies.STREAM_TYPE if parsed[i].stream
                                              else "application/json")
        for group in batcher.fitting_groups(parsed, self.limits.cache_len, max(self.decoders)):
            for i, answer in self.generate(group, parsed, context).items():
                results[i] = answer
        return [json.dumps(r) + "\n" for r in results]

    def generate(self, group: list[int], parsed: dict[int, Any], context) -> dict[int, Any]:
        """Decode the requests `group` (indexes into the batch) in one batch; their answers."""
        rows = [parsed[i] for i in group]
        size = min(b for b in self.decoders if b >= len(rows))
        filler = size - len(rows)  # rows that keep the bucket's shape; one token each
        streams = [requests.TextStream(self.causal_lm.tokenizer, r.stop) for r in rows]

        def on_tokens(produced: list[int | None]) -> list[int]:
            chunks: dict[int, str] = {}
            for k, token in enumerate(produced[:len(rows)]):
                if token is None:
                    continue
                piece = streams[k].add(token)
                if piece and rows[k].stream:
                    chunks[group[k]] = replies.native_chunk(piece, len(streams[k].tokens))
            for i, chunk in chunks.items():
                replies.send(context, i, chunk)
            return [k for k, s in enumerate(streams) if s.stopped]

        seeds = [r.seed for r in rows]
        if (self.ranks > 1 and self.pipe is None and not self.leads
                and any(r.temperature > 0 for r in rows)):  # a leader draws its own seeds
            seeds = tensor_parallel.shared_seeds(seeds)  # a pipeline samples on one rank
        sampling = [loading.Sampling(r.temperature, r.top_p, seed)
                    for r, seed in zip(rows, seeds, strict=True)]
        out = self.decoders[size].generate(
            [r.ids for r in rows] + [rows[0].ids] * filler,
            [r.max_new_tokens for r in rows] + [1] * filler, self.stop,
            sampling + [None] * filler, on_tokens)
        for k, i in enumerate(group):  # what was held back for a stop string never seen
            piece = streams[k].flush()
            if piece and rows[k].stream:
                replies.send(context, i, replies.native_chunk(piece,
                                                              len(streams[k].tokens)))
        return {i: json.loads(replies.internal(context, i, out.finish[k], False,
                                               rows[k].stream and streams[k].sent > 0))
                if out.finish[k].startswith("error") else  # its logits allowed no token
                replies.native_answer(streams[k].text, len(rows[k].ids), len(out.rows[k]),
                                      out.finish[k])
                for k, i in enumerate(group)}


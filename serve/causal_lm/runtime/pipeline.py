"""Pipeline-parallel inference of a causal LM across the ranks of a torchrun job, with torch's
`torch.distributed.pipelining` and no compress code (shipped in the runtime package of a
causal-LM export, and so in its TorchServe archive).

The decoder layers are cut into N contiguous stages, one a rank: the embedding and the first
layers on rank 0, the last layers, the final norm and the output head on rank N-1. Each
rank's `PipelineStage` receives the hidden states (float32) and the attention mask from the
rank before it, and `ScheduleGPipe` runs a batch through them as micro-batches, forward only.
No KV cache crosses the stages: each new token recomputes the whole sequence through the
pipeline; the last rank picks it and `torch.distributed.broadcast` gives it to every rank.
Served (`parallelType: pp`), rank 0 leads each generation (its arguments sent as tensors:
`leader_call.py`) and the others `follow` it;
`pipeline_parallel.py` compares the pipeline with one process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import decode, leader_call, process_group

MAX_SCHEDULES = 64  # one a shape (rows, length, micro-batches): dropped all at once past this


def layer_spans(layers: int, ranks: int) -> list[range]:
    """Contiguous decoder layers of each rank, as even as they divide (the first ranks take
    one more); raises ValueError where a rank would get none."""
    if ranks > layers:
        raise ValueError(f"pipeline_parallel: {ranks} stages for {layers} decoder layers "
                         "would leave a stage empty")
    size, extra = divmod(layers, ranks)
    starts = [r * size + min(r, extra) for r in range(ranks + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:], strict=False)]


class StageModule(nn.Module):
    """One rank's share of a causal LM: (token ids or hidden states, mask) in; (hidden
    states, mask) out, or on the last rank the logits of the last position (of every
    position when `every_position`)."""

    def __init__(self, model: nn.Module, span: range, first: bool, last: bool):
        super().__init__()
        body = model.model
        self.dtype = body.norm.weight.dtype
        body.layers = nn.ModuleList(body.layers[i] for i in span)
        if not first:
            body.embed_tokens = None
        if not last:
            body.norm = nn.Identity()
        self.body, self.head = body, model.lm_head if last else None
        model.lm_head = self.head  # the model keeps this rank's modules alone
        self.first, self.last, self.every_position = first, last, False

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> Any:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: each row from 0
        given = {"input_ids": x} if self.first else {"inputs_embeds": x.to(self.dtype)}
        hidden = self.body(attention_mask=mask, position_ids=positions, use_cache=False,
                           **given).last_hidden_state
        if not self.last:
            return hidden.float(), mask
        if not self.every_position:
            hidden = hidden[:, -1]
        return self.head(hidden).float()


class Pipe:
    """This rank's stage of the pipeline, and one GPipe schedule per input shape (its
    tensor shapes are given, not inferred: a new shape costs one small handshake)."""

    def __init__(self, model: nn.Module, rank: int, ranks: int):
        config = model.config
        spans = layer_spans(config.num_hidden_layers, ranks)
        self.module = StageModule(model, spans[rank], rank == 0, rank == ranks - 1)
        self.rank, self.ranks, self.spans = rank, ranks, spans
        self.hidden, self.vocab = config.hidden_size, config.vocab_size
        self.schedules: dict[tuple[int, int, int, bool], Any] = {}  # ScheduleGPipe

    @property
    def last(self) -> bool:
        return self.rank == self.ranks - 1

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, microbatches: int = 1,
                every_position: bool = False) -> torch.Tensor | None:
        """Logits of a rows x length batch on the last rank (None on the others), run as
        the most micro-batches up to `microbatches` that divide the rows. Every rank calls
        it with the same shapes; only rank 0's `ids` and `mask` are read."""
        rows, length = ids.shape
        chunks = max(c for c in range(1, microbatches + 1) if rows % c == 0)
        key = (rows // chunks, length, chunks, every_position)
        if key not in self.schedules:
            if len(self.schedules) >= MAX_SCHEDULES:
                self.schedules.clear()
            self.schedules[key] = self._schedule(*key)
        self.module.every_position = every_position
        with torch.no_grad():
            schedule = self.schedules[key]
            out = schedule.step(ids, mask) if self.rank == 0 else schedule.step()
        return out if self.last else None

    def _schedule(self, rows: int, length: int, chunks: int, every_position: bool) -> Any:
        # imported here: 2.2 s of a worker's start on a Zen 1, which only a pipeline needs
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device="meta")

        mask = meta(rows, length, dtype=torch.long)
        hidden = meta(rows, length, self.hidden)
        logits = meta(rows, length, self.vocab) if every_position else meta(rows, self.vocab)
        stage = PipelineStage(self.module, self.rank, self.ranks, torch.device("cpu"),
                              input_args=(mask, mask) if self.rank == 0 else (hidden, mask),
                              output_args=logits if self.last else (hidden, mask))
        return ScheduleGPipe(stage, chunks)


class PipelineDecoder:
    """`StaticDecoder.generate` through the pipeline, the whole sequence recomputed per token:
    greedy or top-p sampled on the last rank, each token broadcast from there, and the rows
    rank 0's `on_tokens` finishes broadcast from rank 0. Every rank calls `generate` in
    step and gets the same `Generation`; with `lead`, rank 0's arguments are broadcast to
    the others first (TorchServe's `parallelType: pp` hands each request to rank 0 alone:
    the other ranks `follow`)."""

    compiled = False

    def __init__(self, pipe: Pipe, max_cache_len: int, microbatches: int = 1,
                 lead: bool = False):
        self.pipe, self.max_cache_len, self.microbatches = pipe, max_cache_len, microbatches
        self.lead = lead

    def _next(self, ids: torch.Tensor, mask: torch.Tensor, chunks: int, picks: list[Any],
              generators: list[Any]) -> torch.Tensor:
        logits = self.pipe.forward(ids, mask, chunks)
        token = torch.zeros(ids.shape[0], dtype=torch.long)
        if logits is not None:
            token = decode.pick_tokens(logits, picks, generators)
        dist.broadcast(token, src=self.pipe.ranks - 1)
        return token

    def generate(self, prompt: torch.Tensor | Sequence[Sequence[int]],
                 max_new_tokens: int | Sequence[int], stop: set[int] | None = None,
                 sampling: Sequence[Any] | None = None,
                 on_tokens: decode.OnTokens | None = None) -> decode.Generation:
        """Tokens after each prompt, as `StaticDecoder.generate` gives them (with `lead`,
        rank 0's prompts and settings on every rank)."""
        chunks = self.microbatches
        if self.lead:  # as tensors, never a pickle (leader_call.py)
            call = leader_call.broadcast(leader_call.LeaderCall.of(
                prompt, max_new_tokens, stop, sampling, chunks) if self.pipe.rank == 0
                else None)
            prompt, max_new_tokens, stop = call.prompt, call.max_new_tokens, call.stop
            sampling, chunks = call.sampling, call.chunks
        ids, mask, _ = decode.left_pad(prompt, always_mask=True)
        rows, length = ids.shape
        limits, picks, generators = decode.plan_rows(rows, length, max_new_tokens,
                                                     sampling, self.max_cache_len)
        began = time.perf_counter()
        token = self._next(ids, mask, chunks, picks, generators)
        ttft = time.perf_counter() - began
        out: list[list[int]] = [[] for _ in range(rows)]
        finish: list[str | None] = [None] * rows
        began = time.perf_counter()
        while True:
            produced = decode._record(token, out, finish, limits, stop or set())
            ended = torch.zeros(rows, dtype=torch.uint8)
            if on_tokens is not None and self.pipe.rank == 0:
                ended[list(on_tokens(produced) or ())] = 1
            dist.broadcast(ended, src=0)
            for row in ended.nonzero().flatten().tolist():
                finish[row] = finish[row] or "stop"
            if all(finish):
                break
            ids = torch.cat([ids, token[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones(rows, 1, dtype=mask.dtype)], dim=1)
            token = self._next(ids, mask, chunks, picks, generators)
        spent = time.perf_counter() - began
        later = sum(max(len(r) - 1, 0) for r in out)
        return decode.Generation(out[0], ttft, later / spent if spent and later else 0.0,
                                 out, [str(f) for f in finish])


def follow(decoder: PipelineDecoder) -> threading.Thread:
    """On a rank other than 0 of a served pipeline: run every generation rank 0's leading
    decoders announce (see `follow_leader`)."""
    return follow_leader(lambda: decoder.generate([[0]], 1), "pipeline")


def follow_leader(step: Callable[[], None], what: str) -> threading.Thread:
    """On a rank other than 0 of a served split model: a daemon thread that runs `step`
    (one generation, its arguments from rank 0) again and again, until the process group
    fails; a request refused on every rank alike (ValueError) is skipped."""
    def loop() -> None:
        while True:
            try:
                step()
            except ValueError:  # refused on every rank alike, before any token
                continue
            except Exception:  # noqa: BLE001 (the job is gone: TorchServe restarts it)
                logging.getLogger(__name__).exception("%s follower stopped", what)
                return

    thread = threading.Thread(target=loop, name=f"{what}-follower", daemon=True)
    thread.start()
    return thread


def join_and_split(model: nn.Module, folder: Path) -> Pipe:
    """In a rank of a torchrun job (TorchServe's `parallelType: pp` workers, or any other):
    join the process group (`process_group.join`: on one machine through a FileStore in
    `folder`, on loopback) and keep this rank's stage of `model` (the other layers are
    dropped)."""
    # a follower waits for the next request as long as the server idles (past the default
    # 30 min timeout, its broadcast would fail)
    process_group.join(folder, timeout=timedelta(days=365))
    return Pipe(model, dist.get_rank(), dist.get_world_size())

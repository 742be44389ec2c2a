"""Pipeline-parallel inference of a causal-LM folder across the ranks of a torchrun job, with
torch's `torch.distributed.pipelining` and no compress code (shipped beside `lm_runtime.py`
in a causal-LM export).

The decoder layers are cut into N contiguous stages, one a rank: the embedding and the first
layers on rank 0, the last layers, the final norm and the output head on rank N-1. Each
rank's `PipelineStage` receives the hidden states (float32) and the attention mask from the
rank before it, and `ScheduleGPipe` runs a batch through them as micro-batches, forward only.
No KV cache crosses the stages: each new token recomputes the whole sequence through the
pipeline; the last rank picks it and `torch.distributed.broadcast` gives it to every rank.

    torchrun --nproc-per-node 2 lm_pipeline_parallel.py FOLDER --prompts prompts.txt --out pp.json

prints (and writes to --out, from the last rank) the largest logit difference against the
same model in one process, the greedy tokens of both, the weight bytes each rank holds, and
generation tokens/s at batch 8 with 1, 2 and 4 micro-batches.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

try:  # in an export folder, the runtime lies beside this file
    import lm_decode
    import lm_runtime
except ImportError:  # in the compress repository
    from serve import lm_decode, lm_runtime

MICROBATCHES = (1, 2, 4)
BATCH = 8
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
        self.schedules: dict[tuple[int, int, int, bool], ScheduleGPipe] = {}

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

    def _schedule(self, rows: int, length: int, chunks: int, every_position: bool
                  ) -> ScheduleGPipe:
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

    def __init__(self, pipe: Pipe, max_cache_len: int = 512, microbatches: int = 1,
                 lead: bool = False):
        self.pipe, self.max_cache_len, self.microbatches = pipe, max_cache_len, microbatches
        self.lead = lead

    def _next(self, ids: torch.Tensor, mask: torch.Tensor, chunks: int, picks: list[Any],
              generators: list[Any]) -> torch.Tensor:
        logits = self.pipe.forward(ids, mask, chunks)
        token = torch.zeros(ids.shape[0], dtype=torch.long)
        if logits is not None:
            token = lm_decode.pick_tokens(logits, picks, generators)
        dist.broadcast(token, src=self.pipe.ranks - 1)
        return token

    def generate(self, prompt: torch.Tensor | Sequence[Sequence[int]],
                 max_new_tokens: int | Sequence[int], stop: set[int] | None = None,
                 sampling: Sequence[Any] | None = None,
                 on_tokens: lm_decode.OnTokens | None = None) -> lm_decode.Generation:
        """Tokens after each prompt, as `StaticDecoder.generate` gives them (with `lead`,
        rank 0's prompts and settings on every rank)."""
        chunks = self.microbatches
        if self.lead:
            call = [(prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt,
                     max_new_tokens, stop, sampling, chunks)]
            dist.broadcast_object_list(call, src=0)
            prompt, max_new_tokens, stop, sampling, chunks = call[0]
        ids, mask, _ = lm_decode.left_pad(prompt, always_mask=True)
        rows, length = ids.shape
        limits = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [
            max_new_tokens] * rows
        if length + max(limits) > self.max_cache_len:
            raise ValueError(f"prompt of {length} tokens + {max(limits)} new exceeds the "
                             f"cache of {self.max_cache_len}")
        picks = [s if s and s.temperature > 0 else None for s in (sampling or [None] * rows)]
        generators = [torch.Generator().manual_seed(s.seed) if s and s.seed is not None
                      else None for s in picks]
        began = time.perf_counter()
        token = self._next(ids, mask, chunks, picks, generators)
        ttft = time.perf_counter() - began
        out: list[list[int]] = [[] for _ in range(rows)]
        finish: list[str | None] = [None] * rows
        began = time.perf_counter()
        while True:
            produced = lm_decode._record(token, out, finish, limits, stop or set())
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
        return lm_decode.Generation(out[0], ttft, later / spent if spent and later else 0.0,
                                    out, [str(f) for f in finish])


def follow(decoder: PipelineDecoder) -> threading.Thread:
    """On a rank other than 0 of a served pipeline: a daemon thread that runs every
    generation rank 0's leading decoders announce, until the process group fails."""
    def loop() -> None:
        while True:
            try:
                decoder.generate([[0]], 1)  # the arguments come from rank 0
            except ValueError:  # refused on every rank alike, before any token
                continue
            except Exception:  # noqa: BLE001 (the job is gone: TorchServe restarts it)
                logging.getLogger(__name__).exception("pipeline follower stopped")
                return

    thread = threading.Thread(target=loop, name="pipeline-follower", daemon=True)
    thread.start()
    return thread


def join_and_split(model: nn.Module) -> Pipe:
    """In a rank of a torchrun job (TorchServe's `parallelType: pp` workers, or any other):
    join the process group (gloo on CPU, NCCL on GPUs) and keep this rank's stage of
    `model` (the other layers are dropped)."""
    if not dist.is_initialized():  # a follower waits for the next request as long as the
        # server idles (past the default 30 min timeout, its broadcast would fail)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=timedelta(days=365))
    return Pipe(model, dist.get_rank(), dist.get_world_size())


def weight_bytes(module: nn.Module, projections_only: bool = False) -> int:
    """Bytes of the weights `module` holds (each storage once; a quantized tensor by its
    inner tensors), of the decoder layers' projections (`*_proj`) alone with
    `projections_only`."""
    def inner(t: torch.Tensor) -> list[torch.Tensor]:
        if hasattr(t, "__tensor_flatten__"):
            return [x for n in t.__tensor_flatten__()[0] for x in inner(getattr(t, n))]
        return [t]

    owners = [m for n, m in module.named_modules() if n.endswith("proj")] if (
        projections_only) else [module]
    tensors = [t for m in owners for w in (*m.parameters(), *m.buffers()) for t in inner(w)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def _generate_rate(decoder: PipelineDecoder | Any, prompts: list[list[int]],
                   max_new_tokens: int) -> tuple[float, list[list[int]]]:
    """New tokens a second of one batch of `prompts` (every row to `max_new_tokens`), and
    the rows' tokens."""
    began = time.perf_counter()
    out = decoder.generate(prompts, max_new_tokens)
    return sum(len(r) for r in out.rows) / (time.perf_counter() - began), out.rows


def compare(folder: str, prompts: list[Any], max_new_tokens: int,
            chat_template: bool = True) -> dict[str, Any]:
    """Run on every rank of a torchrun job: the pipeline against the whole model in one
    process (the last rank loads it a second time); the figures on the last rank."""
    ranks, rank = dist.get_world_size(), dist.get_rank()
    lm = lm_runtime.load_folder(folder)
    ids = [lm_runtime.prompt_ids(lm.tokenizer, p, chat_template) for p in prompts]
    whole = lm_runtime.load_folder(folder).model if rank == ranks - 1 else None
    everything = weight_bytes(lm.model)
    pipe = Pipe(lm.model, rank, ranks)
    cache = max(len(i) for i in ids) + max_new_tokens + 8
    decoder = PipelineDecoder(pipe, cache)
    split_logits = [pipe.forward(torch.tensor([i]), torch.ones(1, len(i), dtype=torch.long),
                                 every_position=True) for i in ids]
    split_tokens = [decoder.generate([i], max_new_tokens).tokens for i in ids]
    batch = (ids * BATCH)[:BATCH]
    _generate_rate(decoder, batch, 2)  # warm-up
    rates, rows = {}, []
    for chunks in MICROBATCHES:
        decoder.microbatches = chunks
        rate, rows = _generate_rate(decoder, batch, max_new_tokens)
        rates[chunks] = round(rate, 2)
        split_tokens += rows  # left-padded rows, in micro-batches
    held = [None] * ranks
    dist.all_gather_object(held, (weight_bytes(pipe.module, True), weight_bytes(pipe.module)))
    if whole is None:
        return {}
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # one process may use every core
    with torch.inference_mode():
        whole_logits = [whole(input_ids=torch.tensor([i])).logits[0].float() for i in ids]
    one = lm_decode.StaticDecoder(whole, cache)
    whole_tokens = [one.generate([i], max_new_tokens).tokens for i in ids]
    one.generate(batch, 2)  # warm-up
    rate, rows = _generate_rate(one, batch, max_new_tokens)
    whole_tokens += rows * len(MICROBATCHES)
    diff = max(float((a[0] - b).abs().max()) for a, b in zip(split_logits, whole_logits,
                                                              strict=True))
    # each prompt alone, then the batch of 8 at each micro-batch count
    pairs = [(a, b) for x, y in zip(split_tokens, whole_tokens, strict=True)
             for a, b in zip(x, y, strict=False)]
    return {"pipeline_parallel": ranks, "schedule": "GPipe", "kv_cache": False,
            "layers_per_rank": [len(s) for s in pipe.spans], "prompts": len(ids),
            "max_logit_diff": diff,
            "greedy_agreement": round(sum(a == b for a, b in pairs) / max(len(pairs), 1), 4),
            "projection_weight_bytes_per_rank": [h[0] for h in held],
            "projection_weight_bytes_one_process": weight_bytes(whole, True),
            "weight_bytes_per_rank": [h[1] for h in held],
            "weight_bytes_one_process": everything,
            "generate_tok_s_b8": rates,
            "generate_tok_s_b8_one_process": round(rate, 2),
            "threads_per_rank": threads, "threads_one_process": torch.get_num_threads(),
            "tokens": split_tokens, "tokens_one_process": whole_tokens}


def main(argv: list[str] | None = None) -> None:
    """Compare the pipeline-parallel model with one process (run under torchrun)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--prompts", required=True, help="a text file, one prompt a line (or "
                        "a .json list of prompts and chat message lists)")
    parser.add_argument("--no-chat-template", action="store_true",
                        help="encode prompts as plain text")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", help="write the figures here (JSON)")
    args = parser.parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        parser.error("run it under torchrun: torchrun --nproc-per-node N "
                     "lm_pipeline_parallel.py FOLDER --prompts FILE")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    text = Path(args.prompts).read_text()
    prompts = json.loads(text) if args.prompts.endswith(".json") else [
        line.strip() for line in text.splitlines() if line.strip()]
    try:
        figures = compare(args.folder, prompts, args.max_new_tokens,
                          not args.no_chat_template)
        if figures:
            if args.out:
                Path(args.out).write_text(json.dumps(figures))
            print(json.dumps({k: v for k, v in figures.items() if not k.startswith("tokens")}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

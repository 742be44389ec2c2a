"""How the continuous batcher (`batcher.py`) prefills prompts: the requests admitted at one
step as one batch (left-padded, each row's rotary positions from its own first token), in
chunks of positions interleaved with the running rows' decode steps, through one compiled
graph whose rows and chunk length are dynamic (where the decode step is compiled). With a
prefix cache (`prefix_cache.py`), the positions a prompt shares with one prefilled before
are copied in once, not computed. Torch and transformers only; shipped in `causal_lm`."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from serve.handler_settings import HandlerSettings

from ..runtime.attention import attention, decode_attention_for
from ..runtime.decode import left_pad
from ..runtime.static_cache import empty_cache, first_rows, position_bytes, release
from .picking import MAX_TOP_LOGPROBS
from .prefix_cache import PrefixCache
from .rows import Row

# a prompt token's log-probability and its likeliest rivals' (OpenAI's echo with logprobs)
Scored = tuple[float, list[tuple[int, float]]]
SCORED_CHUNK = 64  # positions a chunk where a prompt is scored: each position's logits are
# kept (rows x 64 x a 49k vocabulary: 12.6 MB a row)


def prefill_chunk(model: nn.Module, cache: Any, ids: torch.Tensor, positions: torch.Tensor,
                  position_ids: torch.Tensor, mask: torch.Tensor, window: torch.Tensor | None,
                  last_only: bool, every: bool = False) -> torch.Tensor:
    """The last position's logits (rows x vocab; `every`: each position's, rows x chunk x
    vocab) of a chunk of `ids` (rows x chunk) written to `cache` at `positions` (the cache's
    write position must be set there), attending to the first `len(window)` cache
    positions where given (those written once this chunk is; the model runs the decode
    attention)."""
    extra: dict[str, Any] = {"decode_window": window} if window is not None else {}
    if last_only and not every:
        extra["logits_to_keep"] = 1
    out = model(input_ids=ids, cache_position=positions, position_ids=position_ids,
                attention_mask=mask, past_key_values=cache, use_cache=True, **extra)
    return out.logits if every else out.logits[:, -1]


@dataclass(eq=False)
class PrefillJob:
    """Rows being prefilled together: their prompts left-padded to one length."""

    rows: list[Row]
    ids: torch.Tensor  # prompts x length: rows with the same prompt share one
    pads: list[int]  # per prompt
    source: list[int]  # per row: its prompt's index (its slot in the prefill's cache)
    done: int = 0  # positions written so far
    logits: torch.Tensor | None = None  # the last position's, per prompt, once done
    # per prompt: the rivals its tokens' scores name, where a row asks for its prompt's
    # scores (None: not scored), and those scores by token index (the first has none)
    rivals: list[int | None] = field(default_factory=list)
    scores: list[dict[int, Scored]] = field(default_factory=list)

    def row_logits(self, index: int) -> torch.Tensor:
        """Row `index`'s logits (1 x vocab), a copy (the batcher masks them in place)."""
        assert self.logits is not None
        slot = self.source[index]
        return self.logits[slot:slot + 1].clone()

    def prompt_scores(self, index: int) -> list[Scored]:
        """Row `index`'s prompt tokens after the first, each its log-probability and rivals
        (the job must have scored its prompt)."""
        slot = self.source[index]
        return [self.scores[slot][k] for k in range(1, self.length - self.pads[slot])]

    @property
    def scoring(self) -> bool:
        return any(top is not None for top in self.rivals)

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    @property
    def finished(self) -> bool:
        return self.done >= self.length


def _size_oblivious(compiled: bool) -> Any:
    """Where the graph compiles, sizes of 1 take its general path rather than a graph of
    their own (a prefill of one row is the common one; Dynamo specializes sizes 0 and 1)."""
    if not compiled:
        return contextlib.nullcontext()
    from torch.fx.experimental import _config

    return _config.patch(backed_size_oblivious=True)


class Prefiller:
    """Prefills `PrefillJob`s over caches of its own (one per row count, `cache_len`
    positions), at most `chunk` positions at a time where others are waiting, and where
    `budgeted` no more than fit a time budget (`step`); through `package` where given (the
    prefill compiled ahead of time, `aot_steps.LoadedPrefill`), else `compiled`: through
    torch.compile, rows and chunk length dynamic (one graph)."""

    def __init__(self, model: nn.Module, cache_len: int,
                 chunk: int = HandlerSettings.prefill_chunk,
                 prefix_cache: PrefixCache | None = None, compiled: bool = False,
                 last_only: bool = True, budgeted: bool = True, max_rows: int | None = None,
                 package: Callable[..., torch.Tensor] | None = None):
        self.model, self.cache_len, self.chunk = model, cache_len, max(1, chunk)
        # rows the batcher admits to one job (None: every free one; fewer delay first tokens:
        # benchmarks/causal_lm/micro/prefill_rows.py)
        self.max_rows = max_rows
        self.prefix_cache, self.last_only = prefix_cache, last_only
        self.workspace: Any = None  # the caches' storage (`_cache`)
        self.caches: dict[int, Any] = {}  # by rows: views of the workspace's first rows
        self.run = torch.compile(prefill_chunk, fullgraph=True) if compiled else prefill_chunk
        if package is not None:  # compiled ahead of time (`aot_steps.LoadedPrefill`)
            self.run, compiled = package, False
        self.compiled = compiled  # through torch.compile
        self.kind = "ahead of time" if package is not None else (
            "compiled" if compiled else "eager")
        self.windowed = decode_attention_for(model) is not None  # see `prefill_chunk`
        self.budgeted = budgeted
        self.position_s: dict[int, float] = {}  # by rows: a row's position, averaged

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Prefill two rows, then one, so that the compiled graphs (rows of 1 have their
        own) compile now, not on a request (in inference mode, as the batcher runs them);
        nothing is cached."""
        with attention(self.model, decode_attention_for(self.model)):  # the batcher's
            for rows in (2, 1):
                job = self.start([Row([0, 0, k], 1, lambda token, end: None)
                                  for k in range(rows)])
                self.step(job, whole=True)
        self.position_s.clear()  # a compiling warm-up says nothing of a chunk's time

    def start(self, rows: list[Row]) -> PrefillJob:
        """A job for `rows`, with the positions their prompts share with cached ones filled;
        rows with the same prompt (a request's `n` choices) are prefilled once."""
        prompts: dict[tuple[int, ...], int] = {}
        source = [prompts.setdefault(tuple(r.ids), len(prompts)) for r in rows]
        ids, _, pads = left_pad([list(p) for p in prompts])
        job = PrefillJob(rows, ids, pads.tolist(), source)
        job.rivals = [None] * len(prompts)
        for row, slot in zip(rows, source, strict=True):
            if row.score_prompt:
                job.rivals[slot] = max(job.rivals[slot] or 0, row.logprobs or 0)
        job.scores = [{} for _ in prompts]
        cache = self._cache(len(prompts))
        # a prompt to score is computed whole: the cache holds no scores of its prefix
        hits = [self.prefix_cache.lookup(list(p))
                if self.prefix_cache and job.rivals[slot] is None else None
                for slot, p in enumerate(prompts)]
        for slot, (hit, pad) in enumerate(zip(hits, job.pads, strict=True)):
            if hit is not None:
                for layer, keys, values in zip(cache.layers, hit.keys, hit.values, strict=True):
                    layer.keys[slot, :, pad:pad + hit.length] = keys
                    layer.values[slot, :, pad:pad + hit.length] = values
        job.done = min(pad + (hit.length if hit else 0)
                       for pad, hit in zip(job.pads, hits, strict=True))
        return job

    def chunk_for(self, rows: int, budget_s: float | None) -> int:
        """Positions of a chunk of `rows` rows that take about `budget_s` (at most `chunk`,
        at least 2), from the time chunks of as many rows took so far (8 before any)."""
        if budget_s is None or not self.budgeted:
            return self.chunk
        if rows not in self.position_s:
            return min(self.chunk, 8)
        return max(2, min(self.chunk, int(budget_s / (self.position_s[rows] * rows))))

    def step(self, job: PrefillJob, whole: bool, budget_s: float | None = None) -> None:
        """Prefill the job's next chunk (`whole`: every position left, where no row is
        waiting for a decode step; else about `budget_s` of work where given: a running
        row's gap between two tokens grows by that much, not by a whole chunk's time)."""
        rows = job.ids.shape[0]
        end = job.length if whole else min(job.length,
                                           job.done + self.chunk_for(rows, budget_s))
        if job.scoring:
            end = min(end, job.done + SCORED_CHUNK)
        if end - job.done < 2 <= job.length:  # positions already written are written again:
            job.done = end - 2  # the graph's chunks are 2 or longer, and a chunk of one
            # would run the decode attention, whose softmax over a pad's fully masked
            # positions is NaN (SDPA's is 0), left in the cache for later chunks to read
        cache = self.caches[rows]
        for layer in cache.layers:
            layer.cumulative_length.fill_(job.done)
        positions = torch.arange(job.done, end)
        pads = torch.tensor(job.pads)
        position_ids = (positions[None] - pads[:, None]).clamp(min=0)
        mask = (torch.arange(self.cache_len)[None] >= pads[:, None]).long()
        # fresh strides (not `contiguous()`, which keeps a one-row slice's): a graph traced on
        # a whole prompt guards them, and a chunk's slice would compile another
        ids = job.ids[:, job.done:end].clone(memory_format=torch.contiguous_format)
        window = torch.empty(end, dtype=torch.int8) if self.windowed else None
        if self.compiled:  # rows: one graph for 1, one for more (matmul tells them apart)
            for tensor in (ids, position_ids, mask):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(ids, 1, min=2, max=self.cache_len)
            torch._dynamo.mark_dynamic(position_ids, 1, min=2, max=self.cache_len)
            torch._dynamo.mark_dynamic(positions, 0, min=2, max=self.cache_len)
            if window is not None:  # (a full window slices nothing: a guard of its own)
                torch._dynamo.maybe_mark_dynamic(window, 0)
        began = time.perf_counter()
        if job.scoring:  # every position's logits: the model's own forward
            every = prefill_chunk(self.model, cache, ids, positions, position_ids, mask,
                                  window, self.last_only, every=True)
            score(job, every, job.done)
            job.logits = every[:, -1]
        else:
            with _size_oblivious(self.compiled):
                job.logits = self.run(self.model, cache, ids, positions, position_ids, mask,
                                      window, self.last_only)
        spent = (time.perf_counter() - began) / (rows * (end - job.done))
        self.position_s[rows] = 0.5 * (self.position_s.get(rows, spent) + spent)
        job.done = end
        if job.finished and self.prefix_cache is not None:
            for index, row in enumerate(job.rows):
                if job.source.index(job.source[index]) == index:  # a prompt's first row
                    keys, values = self.keys_values(job, index)
                    self.prefix_cache.store(row.ids, [k[0] for k in keys],
                                            [v[0] for v in values])

    def release(self, job: PrefillJob) -> None:
        """Hand back the workspace's pages that `job`'s prompts wrote, once its rows' keys and
        values were copied out (into the decoders' cache and the prefix cache, which copies):
        between two jobs the workspace holds nothing, not the largest prompts it has seen
        (a page is given again on the next job's first write)."""
        if self.workspace is not None:
            for slot in range(job.ids.shape[0]):
                release(self.workspace, slot, 0, job.length)

    def keys_values(self, job: PrefillJob, slot: int
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """A finished row's keys and values (row `slot` of the job's rows), per layer
        1 x heads x prompt x dim (views)."""
        slot = job.source[slot]
        pad, cache = job.pads[slot], self.caches[job.ids.shape[0]]
        return ([layer.keys[slot:slot + 1, :, pad:job.length] for layer in cache.layers],
                [layer.values[slot:slot + 1, :, pad:job.length] for layer in cache.layers])

    def _cache(self, rows: int) -> Any:
        """The cache for `rows` rows: the first rows of one workspace, as many rows as the
        largest job so far (made anew, zeroed, when a job needs more), so a worker holds one
        prefill cache, not one for each number of prompts (1 + 2 + ... + 8 rows of 512
        positions were 850 MB for SmolLM2-135M). Its tensors are plain graph inputs, their
        rows dynamic, so one compiled graph serves every count (transformers marks them
        static addresses, which a graph would take for constants)."""
        if self.workspace is None or self.workspace.layers[0].keys.shape[0] < rows:
            self.caches.clear()
            self.workspace = None  # its memory goes before the larger one is made
            self.workspace = empty_cache(self.model, rows, self.cache_len, dynamic_rows=True)
        if rows not in self.caches:
            self.caches[rows] = first_rows(self.model, self.workspace, rows, self.cache_len,
                                           dynamic_rows=True)
        return self.caches[rows]

    def cache_bytes(self) -> int:
        """Bytes of the prefill's workspace (0 before the first prompt)."""
        if self.workspace is None:
            return 0
        return sum(t.nbytes for layer in self.workspace.layers
                   for t in (layer.keys, layer.values))


def score(job: PrefillJob, logits: torch.Tensor, start: int) -> None:
    """Record the scores of the prompt tokens that a chunk's logits (rows x chunk x vocab,
    its first position `start`) predict, for each prompt of `job` that is scored: the
    logits at position q give the token at q + 1 its log-probability."""
    for slot, rivals in enumerate(job.rivals):
        pad = job.pads[slot]
        low, high = max(start, pad), min(start + logits.shape[1], job.length - 1)
        if rivals is None or low >= high:
            continue
        logprobs = torch.log_softmax(logits[slot, low - start:high - start].float(), dim=-1)
        following = job.ids[slot, low + 1:high + 1]
        chosen = logprobs.gather(1, following[:, None])[:, 0].tolist()
        tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
        if rivals:
            values, ids = logprobs.topk(min(rivals, MAX_TOP_LOGPROBS), dim=-1)
            tops = [list(zip(i, v, strict=True))
                    for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        for k, position in enumerate(range(low, high)):
            job.scores[slot][position + 1 - pad] = (chosen[k], tops[k])


def prefiller_of(model: nn.Module, settings: HandlerSettings, cache_len: int,
                 package: Callable[..., torch.Tensor] | None = None) -> Prefiller:
    """The handler's prefiller from model-config's `handler:` settings: `prefill_chunk`
    (positions a chunk), `prefix_cache` (true, false, or the positions it holds; true:
    4 x cache_len) and `prefix_cache_mb` (its bound in MB, where given: wins over the
    positions); through the prefill the archive ships compiled ahead of time (`package`,
    which the package stage exports where `prefill_compile` is on), else eagerly: a worker
    does not compile its prefill at start (its two graphs took 480 s on a 2-core Zen 1, for
    a one-prompt prefill in 0.82x the eager one's time)."""
    return Prefiller(model, cache_len, settings.prefill_chunk,
                     prefix_cache_of(model, settings, cache_len), last_only=last_only(model),
                     package=package if settings.prefill_compile else None)


def last_only(model: nn.Module) -> bool:
    """Whether `model` computes only the last position's logits when asked (transformers'
    `logits_to_keep`): the prefill asks it."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def prefix_cache_of(model: nn.Module, settings: HandlerSettings, cache_len: int
                    ) -> PrefixCache | None:
    """The prefix cache the settings ask for (None: off), bounded in bytes."""
    held = settings.prefix_cache
    if held is False:
        return None
    if settings.prefix_cache_mb is not None:
        bound = int(settings.prefix_cache_mb * 2**20)
    else:
        bound = (4 * cache_len if held is True else int(held or 0)) * position_bytes(model)
    return PrefixCache(bound) if bound > 0 else None

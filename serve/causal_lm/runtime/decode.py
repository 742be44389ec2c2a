"""Batched decoding over a static KV cache, with torch and transformers only (shipped beside
`loading.py` in every causal-LM export and TorchServe archive: it imports nothing from
compress). `StaticDecoder` decodes prompts of any lengths left-padded under an attention
mask; each row stops on its own, greedy or top-p sampled; its decode step compiles into one
Inductor graph, with its own attention for one new token per row (`attention.py`)."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .attention import attention, decode_attention_for
from .static_cache import empty_cache, tie_graphs_to


@dataclass
class Sampling:
    """How one row picks its tokens: greedy at temperature 0, else top-p sampling."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Generation:
    """The tokens of a batch and how long they took."""

    tokens: list[int]  # the first row's
    ttft_s: float  # prefill: the prompts in, the first tokens out
    decode_tokens_per_s: float  # the tokens after each row's first, every row counted
    rows: list[list[int]] = field(default_factory=list)  # every row's tokens
    finish: list[str] = field(default_factory=list)  # per row: "stop" or "length"


NO_TOKEN = -1  # `pick_tokens`' answer for a row whose logits nothing can be picked from
UNUSABLE = "error: its logits were not finite: no token could be picked"  # such a row's end

# on_tokens(the token each row just produced, None for rows already finished) -> rows to
# finish now (a stop string seen, a client gone)
OnTokens = Callable[[list[int | None]], Iterable[int] | None]


def left_pad(prompts: torch.Tensor | Sequence[Sequence[int]], pad_id: int = 0,
             always_mask: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(B x L ids, B x L mask, or None when no row is padded unless `always_mask`, pads
    per row)."""
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    length = max(len(p) for p in prompts)
    pads = torch.tensor([length - len(p) for p in prompts])
    ids = torch.tensor([[pad_id] * (length - len(p)) + list(p) for p in prompts])
    if not int(pads.max()) and not always_mask:
        return ids, None, pads
    return ids, (torch.arange(length) >= pads[:, None]).long(), pads


class StaticDecoder:
    """Decoding over a `StaticCache` of `max_cache_len` positions. The decode step (one
    token per row in, next-token logits out) keeps its shapes from call to call, so
    `compile(mode)` turns it into one Inductor graph; the prefill stays eager. While it
    generates, a model with SDPA or eager attention runs `decode_attention`. A decoder
    keeps the batch size of its first call (a new size allocates a new cache). With
    `always_mask`, batches with no padded row pass an attention mask too, so a compiled
    step has one graph for both."""

    def __init__(self, model: nn.Module, max_cache_len: int, always_mask: bool = False):
        self.model, self.max_cache_len, self.always_mask = model, max_cache_len, always_mask
        self.attention = decode_attention_for(model)
        self.last_logits_only = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.cache: Any = None
        self.cache_rows = 0
        self.step: Callable[..., torch.Tensor] = self._forward
        self.compiled = False
        self.inductor: dict[str, Any] = {}  # Inductor settings while the step compiles
        self.skip_guards = False  # see `_stance`
        self.dynamic_rows = False  # see `share_rows`

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor,
                 position_ids: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None,
                 window: torch.Tensor | None = None) -> torch.Tensor:
        extra = {"decode_window": window} if window is not None else {}
        if self.last_logits_only:  # a prefill needs the last position's logits alone
            extra["logits_to_keep"] = 1
        out = self.model(input_ids=ids, cache_position=positions, position_ids=position_ids,
                         attention_mask=mask, past_key_values=self.cache, use_cache=True,
                         **extra)
        return out.logits[:, -1]

    def compile(self, mode: str = "default", cpp_wrapper: bool = False,
                skip_guards: bool = False) -> StaticDecoder:
        """Run the decode step through torch.compile (fullgraph, Inductor freezing, and
        max-autotune's C++ GEMM templates when `mode` is `max-autotune`) from now on. No
        freezing where a module says `freeze_weights = False` (its packed weights would be
        folded into float constants).

        Less Python between tokens: `cpp_wrapper` has Inductor write the graph's wrapper in
        C++ (the calls of its ~250 kernels; compiling takes about 3x longer), and
        `skip_guards` checks Dynamo's guards on the first step of each generation only
        (`_stance`).

        The Inductor settings are set around each call of the step, where it compiles:
        passed as torch.compile `options`, max-autotune was not applied (no template was
        tried; measured). Each graph checks that it runs on its own decoder's cache
        (`static_cache.tie_graphs_to`); graphs Dynamo holds from earlier decoders are dropped first
        (`torch._dynamo.reset`) so that they do not count towards its recompile limit. An
        earlier decoder still in use compiles again on its next call."""
        torch._dynamo.reset()
        freeze = all(getattr(m, "freeze_weights", True) for m in self.model.modules())
        self.inductor = {"freezing": freeze, "max_autotune": mode == "max-autotune",
                         "cpp_wrapper": cpp_wrapper}
        self.skip_guards = skip_guards
        self.step = torch.compile(self._forward, fullgraph=True)
        self.compiled = True
        return self

    def _stance(self, step: int) -> Any:
        """Dynamo's stance for decode step `step` of a generation: after the first, with
        `skip_guards`, only the guards that tell cached graphs apart are checked. Safe here
        because the first step ran the full check, which picked or compiled this decoder's
        graph for this cache, and later steps change only values and the window's length,
        which is dynamic (tests/unit/test_causal_lm_grouped.py decodes two decoders in turn)."""
        if self.skip_guards and self.compiled and step > 0:
            return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        return contextlib.nullcontext()

    def decode_step(self, tokens: torch.Tensor, cursor: int,
                    position_ids: torch.Tensor | None, mask: torch.Tensor | None,
                    first: bool = True) -> torch.Tensor:
        """Next-token logits (rows x vocab) of one token per row (rows x 1) written at cache
        position `cursor`: the compiled step where `compile` was called. Run inside
        `attention(self.model, self.attention)` (as `generate` does); `first`: the first step
        of a generation (where Dynamo's guards are checked in full, see `_stance`)."""
        if self.dynamic_rows:
            for tensor in (tokens, position_ids, mask):
                if tensor is not None:
                    torch._dynamo.maybe_mark_dynamic(tensor, 0)
        # Inductor's settings apply where the step compiles (its first call, or a recompile)
        with torch._inductor.config.patch(self.inductor), self._stance(0 if first else 1):
            return self.step(tokens, torch.tensor([cursor]), position_ids, mask,
                             self._window(cursor + 1))

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """The last position's logits (1 x vocab) of one prompt, its keys and values written
        to positions 0..len-1 of this decoder's one-row cache (eager; run inside
        `attention(self.model, self.attention)`)."""
        self._fresh_cache(1)
        return self._forward(torch.tensor([list(ids)]), torch.arange(len(ids)))

    def _window(self, filled: int) -> torch.Tensor | None:
        """A tensor as long as the cache positions the decode attention reads, its size
        dynamic to Dynamo (None where the model runs another attention)."""
        if not self.attention:
            return None
        window = torch.empty(filled, dtype=torch.int8)
        # at most max_cache_len - 1: the last token produced is never fed back
        torch._dynamo.mark_dynamic(window, 0, min=2, max=self.max_cache_len - 1)
        return window

    def allocate(self, rows: int, dynamic_rows: bool = False) -> None:
        """A zeroed cache of `rows` rows now (not at the first generation); `dynamic_rows`:
        its tensors are plain graph inputs whose rows the compiled step takes as dynamic,
        and so are the step's inputs from now on (one graph for every bucket of 2 rows or
        more, whose caches are views of this one: `buckets.shared_caches`)."""
        self.cache, self.cache_rows = empty_cache(self.model, rows, self.max_cache_len,
                                                  dynamic_rows), rows
        self.dynamic_rows = dynamic_rows

    def _fresh_cache(self, rows: int) -> None:
        if self.cache is None or rows != self.cache_rows:
            from transformers import StaticCache

            self.cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
            self.cache_rows = rows
        else:
            self.cache.reset()

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor | Sequence[Sequence[int]],
                 max_new_tokens: int | Sequence[int], stop: set[int] | None = None,
                 sampling: Sequence[Sampling | None] | None = None,
                 on_tokens: OnTokens | None = None) -> Generation:
        """Tokens after each prompt (a B x L tensor, or lists of ids of any lengths, left
        padded here), at most `max_new_tokens` (one limit, or one per row). A row ends at a
        token of `stop` (kept in its tokens), at its limit, or when `on_tokens` says so."""
        with attention(self.model, self.attention):
            return self._generate(prompt, max_new_tokens, stop, sampling, on_tokens)

    def _generate(self, prompt: torch.Tensor | Sequence[Sequence[int]],
                  max_new_tokens: int | Sequence[int], stop: set[int] | None,
                  sampling: Sequence[Sampling | None] | None,
                  on_tokens: OnTokens | None) -> Generation:
        ids, mask, pads = left_pad(prompt, always_mask=self.always_mask)
        rows, length = ids.shape
        limits, picks, generators = plan_rows(rows, length, max_new_tokens, sampling,
                                              self.max_cache_len)
        self._fresh_cache(rows)
        padded = mask is not None
        if padded:
            mask = torch.cat([mask, torch.ones(rows, self.max_cache_len - length,
                                               dtype=mask.dtype)], dim=1)
        began = time.perf_counter()
        positions = torch.arange(length)
        logits = self._forward(ids, positions,  # attention over the prompt's positions only
                               (positions - pads[:, None]).clamp(min=0) if padded else None,
                               mask, self._window(length))
        token = pick_tokens(logits, picks, generators)
        ttft = time.perf_counter() - began
        tie_graphs_to(self.cache)
        out: list[list[int]] = [[] for _ in range(rows)]
        finish: list[str | None] = [None] * rows
        began, i = time.perf_counter(), 0
        while True:
            produced = _record(token, out, finish, limits, stop or set())
            for row in (on_tokens(produced) if on_tokens else None) or ():
                finish[row] = finish[row] or "stop"
            if all(finish):
                break
            # the first step of a generation runs Dynamo's full guard check, which picks (or
            # compiles) this decoder's graph; later steps only differ in values and the
            # window's dynamic length (`skip_guards`)
            logits = self.decode_step(token.view(rows, 1), length + i,
                                      (length + i - pads)[:, None] if padded else None,
                                      mask, first=i == 0)
            token = pick_tokens(logits, picks, generators)
            i += 1
        spent = time.perf_counter() - began
        later = sum(max(len(r) - 1, 0) for r in out)
        rate = later / spent if spent > 0 and later else 0.0
        return Generation(out[0], ttft, rate, out, [str(f) for f in finish])


def plan_rows(rows: int, length: int, max_new_tokens: int | Sequence[int],
              sampling: Sequence[Sampling | None] | None, max_cache_len: int
              ) -> tuple[list[int], list[Sampling | None], list[torch.Generator | None]]:
    """Each row's token limit, sampling (None: greedy) and seeded generator, for prompts
    left-padded to `length`; ValueError when the longest would not fit the cache."""
    limits = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else [
        max_new_tokens] * rows
    if length + max(limits) > max_cache_len:
        raise ValueError(f"prompt of {length} tokens + {max(limits)} new exceeds the "
                         f"cache of {max_cache_len}")
    picks = [s if s and s.temperature > 0 else None for s in (sampling or [None] * rows)]
    generators = [torch.Generator().manual_seed(s.seed) if s and s.seed is not None
                  else None for s in picks]
    return limits, picks, generators


def _record(token: torch.Tensor, out: list[list[int]], finish: list[str | None],
            limits: list[int], stop: set[int]) -> list[int | None]:
    """Append each unfinished row's token; mark rows that end with it (a row that got
    NO_TOKEN ends UNUSABLE, its entry of `token` set to 0, so that it still feeds the next
    step's shape)."""
    produced: list[int | None] = []
    for row, value in enumerate(token.tolist()):
        if value == NO_TOKEN:
            token[row] = 0
            finish[row] = finish[row] or UNUSABLE
        if finish[row]:
            produced.append(None)
            continue
        out[row].append(value)
        produced.append(value)
        if value in stop:
            finish[row] = "stop"
        elif len(out[row]) >= limits[row]:
            finish[row] = "length"
    return produced


def pick_tokens(logits: torch.Tensor, picks: list[Sampling | None],
                generators: list[torch.Generator | None]) -> torch.Tensor:
    """The next token of every row: argmax, or a top-p sample at the row's temperature;
    NO_TOKEN for a row whose logits no token can be picked from (a NaN or +inf among them,
    or every one -inf: `torch.multinomial` raised on such a row and failed the others).
    One pass over the logits: a row's maximum is NaN where it holds a NaN, +inf where it
    holds a +inf and -inf where every one is, and `max` gives `argmax`'s index (the first
    of equal maxima); an argmax and two comparisons over 49152-wide rows took 0.30 ms at 1
    row and 1.39 ms at 8 on a Zen 1 (now 0.11 and 0.30)."""
    best, greedy = logits.max(-1)
    unusable = best.isfinite().logical_not_()
    if not any(picks) and not unusable.any():
        return greedy
    chosen = greedy.masked_fill(unusable, NO_TOKEN)
    for row, how in enumerate(picks):
        if how is None or unusable[row]:
            continue
        probs = torch.softmax(logits[row].float() / how.temperature, dim=-1)
        ranked, order = probs.sort(descending=True)
        keep = (ranked.cumsum(-1) - ranked) < how.top_p  # the smallest set reaching top_p
        keep[0] = True  # the likeliest token always (a top_p below float32's least: none)
        ranked = ranked * keep
        total = ranked.sum()
        if not torch.isfinite(total) or total <= 0:  # overflowed at this temperature
            chosen[row] = NO_TOKEN
            continue
        index = torch.multinomial(ranked / total, 1, generator=generators[row])
        chosen[row] = order[index[0]]
    return chosen

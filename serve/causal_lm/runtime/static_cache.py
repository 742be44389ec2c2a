"""The static KV caches the decoders write (torch and transformers only; shipped beside
`decode.py`): a zeroed one made ahead of the first generation (`empty_cache`), whose
positions a row no longer reads go back to the system (`release`), and how a
compiled graph is kept to the cache it was compiled for (`tie_graphs_to`), and a cache that
is a view of another's first rows (`first_rows`), as the smaller decode buckets and the
prefill's jobs hold theirs."""

from __future__ import annotations

import functools
import mmap
import warnings
from typing import Any

import torch
from torch import nn


def empty_cache(model: nn.Module, rows: int, cache_len: int, dynamic_rows: bool) -> Any:
    """A zeroed `StaticCache` of `rows` rows and `cache_len` positions for `model`, its keys
    and values in memory the system zeroes as it is first written (`untouched_zeros`): a
    position no row has reached takes none. With `dynamic_rows`, its tensors are no static
    addresses (transformers marks them so; a graph compiled under Inductor's freezing would
    take them for constants) and their rows may vary from graph input to graph input."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=cache_len)
    heads, dim, dtype = _layout(model)
    cache.early_initialization(rows, heads, dim, dtype, torch.device("meta"))  # no memory
    sizes = [layer.keys.numel() + layer.values.numel() for layer in cache.layers]
    flat, memory = untouched_zeros(sum(sizes), dtype)
    begin = 0
    for layer, size in zip(cache.layers, sizes, strict=True):
        keys, values = flat[begin:begin + size].split([layer.keys.numel(),
                                                       layer.values.numel()])
        begin += size
        for name, value in list(vars(layer).items()):
            if isinstance(value, torch.device) and value.type == "meta":
                setattr(layer, name, torch.device("cpu"))
            elif isinstance(value, torch.Tensor) and value.is_meta:
                made = {"keys": keys, "values": values}.get(name)
                made = (made.view(value.shape) if made is not None else
                        torch.zeros(value.shape, dtype=value.dtype))
                if not dynamic_rows:  # as transformers marks them
                    torch._dynamo.mark_static_address(made)
                setattr(layer, name, made)
        if dynamic_rows:
            for tensor in (layer.keys, layer.values):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
    cache.memory, cache.memory_base = memory, flat.data_ptr()  # for `release` and `reset`
    cache.reset = functools.partial(_give_back, cache)  # not a write of every page
    return cache


def cache_tensors(cache: Any) -> tuple[list[torch.Tensor], ...]:
    """A static cache's keys, values and lengths, layer by layer (what a compiled step or
    prefill takes as inputs it writes in place)."""
    layers = cache.layers
    return ([x.keys for x in layers], [x.values for x in layers],
            [x.cumulative_length for x in layers])


def release(cache: Any, row: int, begin: int = 0, end: int | None = None) -> None:
    """Hand positions `begin`..`end`-1 of one row of an `empty_cache` back to the system, in
    every layer's keys and values (their next read is zeros, their next write takes a
    fresh page): the pages wholly inside that range, so a position sharing a page with one
    kept stays. For a cache that is not an `empty_cache` (no mmap of its own), nothing.

    The continuous batcher calls it for the positions no row reads (a slot a row left, the
    positions before a row's first, those after the cursor once rows moved), so that a
    cache under steady load holds its rows' positions and not every position the cursor
    has swept."""
    memory = getattr(cache, "memory", None)
    if memory is None:
        return
    for layer in cache.layers:
        for tensor in (layer.keys, layer.values):  # rows x heads x positions x dim
            stop = tensor.shape[2] if end is None else min(end, tensor.shape[2])
            if stop <= begin:
                continue
            if begin == 0 and stop == tensor.shape[2]:  # the whole row: its heads at once
                spans = [(tensor[row].data_ptr(), tensor[row].numel())]
            else:
                spans = [(tensor[row, head, begin].data_ptr(), (stop - begin) * tensor.stride(2))
                         for head in range(tensor.shape[1])]
            for address, count in spans:
                offset = address - cache.memory_base
                low = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
                high = (offset + count * tensor.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
                if high > low:
                    memory.madvise(mmap.MADV_DONTNEED, low, high - low)


def _give_back(cache: Any) -> None:
    """A cache's `reset`: its keys and values zeros again by handing their pages back to the
    system (madvise DONTNEED on their mmap: the next write takes a fresh zeroed page), where
    transformers' writes every page; its write positions to 0."""
    cache.memory.madvise(mmap.MADV_DONTNEED)
    for layer in cache.layers:
        if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            layer.cumulative_length.zero_()


def untouched_zeros(count: int, dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap]:
    """`count` zeros of `dtype` in fresh anonymous memory, and that mmap (the tensor keeps it
    alive): the system gives each page when it is first written, so a cache's positions take
    memory once written (the prefill's workspace holds the prompts' positions, not
    cache_len's); torch.zeros writes every page at once."""
    memory = mmap.mmap(-1, max(1, count * dtype.itemsize),
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():  # the buffer is writable: torch's warning is not ours
        warnings.simplefilter("ignore")
        return torch.frombuffer(memory, dtype=dtype, count=count), memory


def position_bytes(model: nn.Module) -> int:
    """Bytes that one position of one row takes in a cache of `model` (keys and values, every
    layer): 46,080 for SmolLM2-135M in float32."""
    heads, dim, dtype = _layout(model)
    return 2 * model.config.num_hidden_layers * heads * dim * dtype.itemsize


def _layout(model: nn.Module) -> tuple[int, int, torch.dtype]:
    """A cache layer's key-value heads, head dimension and dtype for `model`."""
    config = model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return heads, dim, getattr(model, "dtype", torch.float32)


def first_rows(model: nn.Module, big: Any, rows: int, cache_len: int, dynamic_rows: bool
               ) -> Any:
    """A `StaticCache` whose keys and values are views of the first `rows` rows of `big`'s
    (no memory of its own) and whose write positions and reset are `big`'s; with
    `dynamic_rows`, its rows may vary from graph input to graph input."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=cache_len)
    for mine, whole in zip(cache.layers, big.layers, strict=True):
        mine.lazy_initialization(whole.keys[:rows], whole.values[:rows])
        mine.keys, mine.values = whole.keys[:rows], whole.values[:rows]
        mine.cumulative_length = whole.cumulative_length
        for tensor in (mine.keys, mine.values, mine.cumulative_length):
            if dynamic_rows and hasattr(tensor, "_dynamo_static_input_type"):
                del tensor._dynamo_static_input_type
        if dynamic_rows:
            for tensor in (mine.keys, mine.values):
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
    if "reset" in vars(big):  # zeroed through the whole one's (one cache in use at a time)
        cache.reset = big.reset
    return cache


def tie_graphs_to(cache: Any) -> None:
    """Make every graph compiled from now on check that it runs on this cache's tensors.

    transformers marks a StaticCache's keys, values and lengths as static addresses with no
    guard; under Inductor freezing Dynamo then bakes them into the graph as attributes and
    checks only their shapes. A decoder whose cache matched those shapes (the batch size
    made dynamic by an earlier bucket) ran another decoder's graph on that decoder's cache:
    wrong tokens, or Inductor's size assertion when the rows differed. Guarded, each cache
    tensor adds an identity check, so each decoder compiles its own graph."""
    for layer in getattr(cache, "layers", ()):
        for value in vars(layer).values():
            if getattr(value, "_dynamo_static_input_type", None) == "unguarded":
                torch._dynamo.mark_static_address(value, guard=True)

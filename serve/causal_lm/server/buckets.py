"""The decode batch sizes of the causal-LM handler (`buckets`: each compiles once), the
slots of its continuous batch, how the smaller buckets' caches share the largest one's
(`shared_caches`), and how a TorchServe batch splits into groups that fit the cache without
continuous batching (`fitting_groups`). Torch and transformers only; shipped in the
`causal_lm` package."""

from __future__ import annotations

from typing import Any

from ..runtime.decode import StaticDecoder
from ..runtime.static_cache import first_rows


def shared_caches(decoders: dict[int, StaticDecoder]) -> None:
    """Give every decoder a cache that is a view of the first slots of the largest one's
    (initialized by a first `generate` on the largest, or `allocate`), sharing its write
    positions; where the largest's rows are dynamic (`allocate`), so are the views'."""
    largest = decoders[max(decoders)]
    for rows, decoder in decoders.items():
        if decoder is largest:
            continue
        decoder.cache = first_rows(decoder.model, largest.cache, rows, decoder.max_cache_len,
                                   largest.dynamic_rows)
        decoder.cache_rows, decoder.dynamic_rows = rows, largest.dynamic_rows


def buckets(batch_size: int) -> list[int]:
    """Decode batch sizes: powers of two below `batch_size`, and `batch_size`."""
    sizes = [1 << k for k in range(max(batch_size, 1).bit_length()) if 1 << k < batch_size]
    return sizes + [max(batch_size, 1)]


def fitting_groups(parsed: dict[int, Any], cache_len: int, largest: int) -> list[list[int]]:
    """The requests split, in order, into groups of at most `largest` whose longest prompt
    plus largest max_new_tokens fits the cache (left padding aligns every row's end)."""
    groups: list[list[int]] = []
    for i, request in parsed.items():
        group = groups[-1] if groups else None
        if group is not None and len(group) < largest:
            prompt = max(len(request.ids), *(len(parsed[j].ids) for j in group))
            new = max(request.max_new_tokens, *(parsed[j].max_new_tokens for j in group))
            if prompt + new <= cache_len:
                group.append(i)
                continue
        groups.append([i])
    return groups

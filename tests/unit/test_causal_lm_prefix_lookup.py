"""The prefix cache's lookup (serve/causal_lm/server/prefix_cache.py) walks a token trie:
it finds the longest cached prefix, as a scan of every entry finds it, at a cost that grows
with the prompt, not with the entries held (it ran on the batcher's thread: 28 ms at 8192
cached positions when it scanned)."""

from __future__ import annotations

import random

import torch

from serve.causal_lm.server.prefix_cache import MIN_REUSE, PrefixCache

POSITION = 2 * 2 * 4  # bytes a position: keys and values of 2 float32 each (`kv`)


def kv(ids: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    values = torch.tensor(ids, dtype=torch.float32)[None, :, None].expand(1, -1, 2)
    return [values.clone()], [values + 1]


def scanned(cache: PrefixCache, ids: list[int]) -> int:
    """The longest prefix of ids[:-1] that an entry held now shares: every entry compared."""
    best = 0
    for key in cache.entries:
        shared = 0
        for a, b in zip(key, ids[:-1], strict=False):
            if a != b:
                break
            shared += 1
        best = max(best, shared)
    return best if best >= MIN_REUSE else 0


def test_a_lookup_finds_the_longest_prefix_a_scan_finds() -> None:
    rng = random.Random(0)
    cache = PrefixCache(max_bytes=400 * POSITION)
    stems = [[rng.randrange(5) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    hits = 0
    for turn in range(600):
        ids = rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randrange(0, 25))]
        if turn % 3 == 0:
            cache.store(ids, *kv(ids))
            continue
        want = scanned(cache, ids)
        hit = cache.lookup(ids)
        assert (hit.length if hit else 0) == want, (turn, ids)
        if hit:
            hits += 1
            keys, values = kv(ids[:hit.length])
            assert torch.equal(hit.keys[0], keys[0]) and torch.equal(hit.values[0], values[0])
        assert cache.tokens == sum(len(k) for k in cache.entries) <= 400
        assert cache.bytes == cache.tokens * POSITION <= cache.max_bytes
    assert 50 < hits < 400 and cache.stats()["hits"] == hits


def test_a_lookup_visits_the_prompts_tokens_not_the_entries() -> None:
    small, large = PrefixCache(10**6 * POSITION), PrefixCache(10**6 * POSITION)
    prompts = [[k, *range(1000, 1063)] for k in range(2000)]  # 2000 entries of 64 tokens
    for ids in prompts[:2]:
        small.store(ids, *kv(ids))
    for ids in prompts:
        large.store(ids, *kv(ids))
    wanted = prompts[1][:40] + [7, 7, 7]
    for cache in (small, large):
        assert cache.lookup(wanted).length == 40
        assert cache.last_visited <= len(wanted)
    missing = [5000, *range(1000, 1063)]
    assert large.lookup(missing) is None and large.last_visited <= 1

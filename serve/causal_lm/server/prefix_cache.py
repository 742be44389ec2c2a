"""Keys and values of prompts already prefilled, reused by later prompts that start the
same way (a shared system prompt, a chat's earlier turns): torch only; shipped in the
`causal_lm` package.

An entry is one prompt's keys and values (every layer, positions 0..len-1, one row) under
its token ids. A new prompt takes the entry sharing its longest common prefix: the keys and
values of a position depend on the tokens up to it alone (a causal model, rotary positions
counted from the prompt's first token), so those positions are copied once, at admission,
and only the rest is computed. At least the prompt's last token is always computed, for
its logits. The cache holds at most `max_bytes` of keys and values in all (the handler's
`prefix_cache` positions, or `prefix_cache_mb`) and evicts the least recently used entries
past it; `stats()` says what it holds (the handler's metrics and `/metrics` show it).

Lookups walk a token trie over the entries (as SGLang's radix cache does): one node a
position, each node knowing the entries that pass through it, so a lookup visits at most
the prompt's tokens (`last_visited`), however many entries are held; a scan of every
entry took 28 ms at 8192 cached positions, on the batcher's thread.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

import torch

MIN_REUSE = 8  # fewer shared tokens than this are computed again (a copy is not worth it)


@dataclass
class Prefix:
    """The keys and values of the first `length` positions of an entry."""

    keys: list[torch.Tensor]  # per layer: heads x length x dim
    values: list[torch.Tensor]
    length: int
    nbytes: int = 0  # of the entry's keys and values (a lookup's views: 0)


class _Node:
    """A trie node: the next token's nodes, the entries whose ids pass through it (by
    their serial numbers, in the order they were stored: a long tuple's hash is not cached)
    and the one that ends at it."""

    __slots__ = ("children", "entries", "ends")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.entries: dict[int, tuple[int, ...]] = {}
        self.ends: tuple[int, ...] | None = None


class PrefixCache:
    """Least-recently-used entries of prompts' keys and values, `max_bytes` in all."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max(0, int(max_bytes))
        self.entries: collections.OrderedDict[tuple[int, ...], Prefix] = \
            collections.OrderedDict()
        self.root = _Node()  # the entries' ids, one node a position
        self.serials: dict[tuple[int, ...], int] = {}  # each entry's number in the trie
        self.stored = 0  # entries stored so far (the next serial number)
        self.tokens = 0  # positions held
        self.bytes = 0  # bytes of their keys and values
        self.hits = self.misses = self.reused = 0  # lookups, and positions not computed
        self.last_visited = 0  # trie nodes the last lookup visited

    def lookup(self, ids: list[int]) -> Prefix | None:
        """The longest cached prefix of `ids` (at most all but its last token), as views of
        the entry's tensors; None below MIN_REUSE tokens. The entry becomes the most
        recently used."""
        node, best = self.root, 0
        for token in itertools.islice(ids, max(len(ids) - 1, 0)):
            child = node.children.get(token)
            if child is None:
                break
            node, best = child, best + 1
        self.last_visited = best
        best_key = next(iter(node.entries.values()), None) if best else None
        if best_key is None or best < MIN_REUSE:
            self.misses += 1
            return None
        self.entries.move_to_end(best_key)
        entry = self.entries[best_key]
        self.hits, self.reused = self.hits + 1, self.reused + best
        return Prefix([k[:, :best] for k in entry.keys], [v[:, :best] for v in entry.values],
                      best)

    def store(self, ids: list[int], keys: list[torch.Tensor],
              values: list[torch.Tensor]) -> None:
        """Keep a prompt's keys and values (per layer heads x len(ids) x dim; copied here)
        and evict the least recently used entries past `max_bytes` (one larger than that
        alone is not kept). An entry that a stored one extends is dropped (the longer one
        answers for both)."""
        key = tuple(ids)
        size = sum(t.nbytes for t in (*keys, *values))
        if size > self.max_bytes or len(key) < MIN_REUSE:
            return
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        serial, self.stored = self.stored, self.stored + 1
        self.serials[key] = serial
        node, extended = self.root, []
        for token in key:
            node = node.children.setdefault(token, _Node())
            if node.ends is not None:  # an entry it extends
                extended.append(node.ends)
            node.entries[serial] = key
        node.ends = key
        for other in extended:
            self._drop(other)
        self.entries[key] = Prefix([k.clone() for k in keys], [v.clone() for v in values],
                                   len(key), size)
        self.tokens, self.bytes = self.tokens + len(key), self.bytes + size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        """Remove an entry, and the trie nodes only it passed through."""
        entry = self.entries.pop(key)
        self.tokens, self.bytes = self.tokens - entry.length, self.bytes - entry.nbytes
        serial = self.serials.pop(key)
        node = self.root
        for token in key:
            child = node.children[token]
            del child.entries[serial]
            if not child.entries:  # nothing else passes here: the rest of the path goes
                del node.children[token]
                return
            node = child
        node.ends = None

    def stats(self) -> dict[str, int]:
        """Entries, positions and bytes held (and the bound), hits, misses and positions
        reused so far."""
        return {"entries": len(self.entries), "tokens": self.tokens, "bytes": self.bytes,
                "max_bytes": self.max_bytes, "hits": self.hits, "misses": self.misses,
                "reused_tokens": self.reused}

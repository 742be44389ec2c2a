"""Keys and values of prompts already prefilled, reused by later prompts that start the
same way (a shared system prompt, a chat's earlier turns): torch only; shipped in the
`causal_lm` package.

An entry is one prompt's keys and values (every layer, positions 0..len-1, one row) under
its token ids. A new prompt takes the entry sharing its longest common prefix: the keys and
values of a position depend on the tokens up to it alone (a causal model, rotary positions
counted from the prompt's first token), so those positions are copied once, at admission,
and only the rest is computed. At least the prompt's last token is always computed, for
its logits. The cache holds at most `max_tokens` positions in all and evicts the least
recently used entries past it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

MIN_REUSE = 8  # fewer shared tokens than this are computed again (a copy is not worth it)


@dataclass
class Prefix:
    """The keys and values of the first `length` positions of an entry."""

    keys: list[torch.Tensor]  # per layer: heads x length x dim
    values: list[torch.Tensor]
    length: int
    ids: torch.Tensor | None = None  # an entry's token ids (compared on each lookup)


class PrefixCache:
    """Least-recently-used entries of prompts' keys and values, `max_tokens` positions in
    all."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max(0, max_tokens)
        self.entries: collections.OrderedDict[tuple[int, ...], Prefix] = \
            collections.OrderedDict()
        self.tokens = 0  # positions held
        self.hits = self.misses = self.reused = 0  # lookups, and positions not computed

    def lookup(self, ids: list[int]) -> Prefix | None:
        """The longest cached prefix of `ids` (at most all but its last token), as views of
        the entry's tensors; None below MIN_REUSE tokens. The entry becomes the most
        recently used."""
        best, best_key = 0, None
        if self.entries:
            wanted = torch.tensor(ids[:-1])
            for key, entry in self.entries.items():
                length = min(len(key), len(wanted))
                if length <= best or entry.ids is None:
                    continue
                same = entry.ids[:length] == wanted[:length]
                shared = int(same.cumprod(0).sum()) if length else 0
                if shared > best:
                    best, best_key = shared, key
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
        and evict the least recently used entries past `max_tokens`. An entry that a stored
        one extends is dropped (the longer one answers for both)."""
        key = tuple(ids)
        if len(key) > self.max_tokens or len(key) < MIN_REUSE:
            return
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        for other in [k for k in self.entries if len(k) < len(key) and key[:len(k)] == k]:
            self.tokens -= len(other)
            del self.entries[other]
        self.entries[key] = Prefix([k.clone() for k in keys], [v.clone() for v in values],
                                   len(key), torch.tensor(key))
        self.tokens += len(key)
        while self.tokens > self.max_tokens:
            _, evicted = self.entries.popitem(last=False)
            self.tokens -= evicted.length

    def stats(self) -> dict[str, int]:
        """Entries, positions held, hits, misses and positions reused so far."""
        return {"entries": len(self.entries), "tokens": self.tokens, "hits": self.hits,
                "misses": self.misses, "reused_tokens": self.reused}

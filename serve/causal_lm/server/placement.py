"""Where the continuous batcher's rows sit in its shared cache (`batcher.py`): every row
writes its next token at one cursor position, each row's keys and values end just before
it. A new prompt must end at the cursor with room after it for its new tokens and every
busy row's rest; where the cursor would run past the cache, every row moves left by the
oldest row's start, and where the prompt is longer than the cursor, right. The positions
no row reads (a slot no row holds, a slot's positions before its row's first and after the
cursor) go back to the system (`static_cache.release`): a cache under steady load holds its
rows' positions, not every position the cursor swept (torch only; shipped in the
`causal_lm` package)."""

from __future__ import annotations

from typing import Any

import torch

from ..runtime.static_cache import release
from .rows import Row


class Placement:
    """The cursor, the slots' masks and the moves of `ContinuousBatcher` (its state:
    `slots`, `cache`, `cursor`, `mask`, `cache_len`)."""

    slots: list[Row | None]
    cache: Any
    cursor: int
    mask: torch.Tensor
    cache_len: int

    def _place(self, length: int, new: int, move: bool = False) -> bool:
        """Whether a prompt of `length` tokens can end at the cursor with `new` tokens after
        it, as can every busy row's rest: once every row's positions move left by the oldest
        row's start where the cursor would run past the cache, then right where the prompt
        is longer than the cursor. `move`: make those moves."""
        busy = [r for r in self.slots if r is not None]
        if not busy:
            if move:
                self._set_cursor(length)
            return True
        left = max(r.max_new_tokens - len(r.tokens) for r in busy)
        cursor, by = self.cursor, min(r.start for r in busy)
        if cursor + max(left, new) > self.cache_len and by > 0:
            if move:
                self._move(by, cursor, -by)
            cursor -= by
        if cursor < length and length + left <= self.cache_len:
            if move:
                self._move(0, cursor, length - cursor)
            cursor = length
        return cursor + max(left, new) <= self.cache_len and length <= cursor

    def _position(self, row: Row | None) -> int:
        """The rotary position of the token `row` writes at the cursor: the positions of
        its span it holds (its holes left out, `speculation.py`); 0 for a free slot."""
        return self.cursor - row.start - row.holes if row is not None else 0

    def _move(self, begin: int, end: int, by: int) -> None:
        """Positions begin..end-1 of every slot to begin+by.., and the rows with them (their
        masks too: a row's holes stay closed, `speculation.py`)."""
        for layer in self.cache.layers:
            for t in (layer.keys, layer.values):
                t[:, :, begin + by:end + by] = t[:, :, begin:end].clone()
        self._set_cursor(self.cursor + by)
        moved = torch.zeros_like(self.mask)
        moved[:, begin + by:end + by] = self.mask[:, begin:end]
        moved[:, end + by:] = 1  # from the cursor on: open, as `_open_from` leaves them
        for slot, row in enumerate(self.slots):
            if row is None:
                release(self.cache, slot)
                continue
            row.start += by
            self.mask[slot] = moved[slot]
            release(self.cache, slot, 0, row.start)  # what the move left there
            release(self.cache, slot, self.cursor)

    def _set_cursor(self, position: int) -> None:
        """Every row writes at `position` next (each layer's write position with it; a step
        advances both by one)."""
        self.cursor = position
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(position)

    def _fill(self, slot: int, start: int, keys: list[torch.Tensor],
              values: list[torch.Tensor]) -> None:
        """Write a row's keys and values (per layer 1 x heads x length x dim) into `slot`,
        ending just before the cursor, and open its mask from `start` (the rest of the slot
        handed back first: what a row before it, or the steps while it was free, wrote)."""
        release(self.cache, slot)
        for mine, k, v in zip(self.cache.layers, keys, values, strict=True):
            mine.keys[slot, :, start:self.cursor] = k[0]
            mine.values[slot, :, start:self.cursor] = v[0]
        self._open_from(slot, start)

    def _open_from(self, slot: int, start: int) -> None:
        """The slot's mask: its positions from `start` on."""
        self.mask[slot] = (torch.arange(self.cache_len) >= start).long()

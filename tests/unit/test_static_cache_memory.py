"""A KV cache takes memory for the positions written, not for its length
(serve/causal_lm/runtime/static_cache.py: `empty_cache` over `untouched_zeros`): the
prefill's workspace and the decoders' cache hold cache_len positions a row, of which a chat
prompt writes a few dozen."""

from __future__ import annotations

import functools
import mmap
import os
import warnings

import pytest
import torch
from batcher_checks import alone, prompt, varied_model

from compress.system.processes import pss_bytes
from serve.causal_lm.runtime.decode import StaticDecoder
from serve.causal_lm.runtime.static_cache import empty_cache, position_bytes, release
from serve.causal_lm.server.batcher import ContinuousBatcher, Row
from serve.causal_lm.server.compiled_graphs import warm_up
from serve.causal_lm.server.prefill import Prefiller

MB = 2**20


def test_a_cache_takes_memory_as_its_positions_are_written_and_a_reset_gives_it_back(
        ) -> None:
    model = varied_model()
    rows, positions = 8, 32768  # 256 B a position: 64 MB in all
    whole = rows * positions * position_bytes(model)
    before = pss_bytes(os.getpid())
    cache = empty_cache(model, rows, positions, dynamic_rows=True)
    made = pss_bytes(os.getpid())
    assert made - before < 4 * MB, (made - before) / MB
    layer = cache.layers[0]
    assert layer.keys.shape == (rows, 2, positions, 8) and whole == 64 * MB
    for lay in cache.layers:  # zeros, read without being taken
        assert not lay.keys.any() and not lay.values.any()
    made = pss_bytes(os.getpid())
    for lay in cache.layers:  # a quarter of the positions of every row
        lay.keys[:, :, :positions // 4] = 1.0
        lay.values[:, :, :positions // 4] = 2.0
    written = pss_bytes(os.getpid())
    assert 0.2 * whole < written - made < 0.35 * whole, (written - made) / MB
    assert float(layer.values[3, 1, positions // 4 - 1].sum()) == 16.0
    assert float(layer.values[3, 1, positions // 4].sum()) == 0.0
    cache.reset()  # zeros again, its pages handed back: not a write of every page
    assert pss_bytes(os.getpid()) - made < 4 * MB
    assert not layer.keys.any() and not layer.values.any()
    assert int(layer.cumulative_length) == 0


def resident_fraction(cache) -> float:
    """The share of a cache's mmap pages that hold memory now, page by page from
    /proc/self/pagemap (exact, where the process's PSS moves with everything else): mapped,
    and not to the system's zero page, which a page only read since its release maps."""
    page, size = mmap.PAGESIZE, len(cache.memory)
    frames = page_frames(cache.memory_base, size // page)
    zero = zero_page_frame()
    return sum(f is not None and f != zero for f in frames) / len(frames)


def page_frames(address: int, count: int) -> list[int | None]:
    """The page frame of each of `count` pages from `address` (None: not mapped)."""
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(address // mmap.PAGESIZE * 8)
        entries = pagemap.read(count * 8)
    words = (int.from_bytes(entries[i:i + 8], "little") for i in range(0, len(entries), 8))
    return [w & ((1 << 55) - 1) if w >> 63 & 1 else None for w in words]


@functools.cache
def zero_page_frame() -> int:
    """The frame a read of untouched anonymous memory maps (the system's zero page); the
    test needs the frames pagemap shows to privileged processes alone."""
    probe = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        view = torch.frombuffer(probe, dtype=torch.uint8)
        assert int(view[0]) == 0  # read, not written
        (frame,) = page_frames(view.data_ptr(), 1)
    del view
    if not frame:
        pytest.skip("/proc/self/pagemap shows no page frames to this user (needs "
                    "CAP_SYS_ADMIN): a released page cannot be told from one read since")
    return frame


def test_released_positions_read_zeros_and_take_no_memory_their_neighbours_stay() -> None:
    model = varied_model()
    rows, positions = 4, 4096  # a head's positions of a row: 128 KB, 128 positions a page
    cache = empty_cache(model, rows, positions, dynamic_rows=True)
    for lay in cache.layers:
        lay.keys.fill_(1.0)
        lay.values.fill_(2.0)
    assert resident_fraction(cache) == 1.0
    release(cache, 1, 128, 1024)  # 7 whole pages of each head of row 1
    per_row = 1 / rows  # (measured before the reads: a read maps the system's zero page)
    assert abs(resident_fraction(cache) - (1 - per_row * 7 / 32)) < 1e-9
    release(cache, 2, 100, 200)  # no whole page inside: nothing goes
    release(cache, 3)  # the whole row
    assert abs(resident_fraction(cache) - (1 - per_row * (1 + 7 / 32))) < 1e-9
    layer = cache.layers[1]
    assert not layer.keys[1, :, 128:1024].any() and not layer.values[1, :, 128:1024].any()
    assert bool((layer.values[1, :, :128] == 2.0).all())
    assert bool((layer.values[1, :, 1024:] == 2.0).all())
    assert bool((layer.keys[[0, 2]] == 1.0).all())
    assert not layer.keys[3].any() and not cache.layers[0].values[3].any()
    layer.keys[3, 0, 5] = 3.0  # a write takes a fresh page again
    assert float(layer.keys[3, 0, 5].sum()) == 24.0 and float(layer.keys[3, 0, 6].sum()) == 0


def test_a_busy_batcher_s_cache_holds_its_rows_positions_not_every_position_swept(
        monkeypatch) -> None:
    """Requests through the continuous batcher, the cursor sweeping the cache and rows
    moving left: at every turn the cache holds about the busy rows' positions, and nothing
    once every row left; the rows decode their alone tokens."""
    # heads of 64 as SmolLM2's: 16 positions a page
    model = varied_model(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=1024)
    cache_len = 1024
    decoders = {size: StaticDecoder(model, cache_len, always_mask=True) for size in (1, 2, 4)}
    warm_up(decoders, shared=True)
    batcher = ContinuousBatcher(decoders, Prefiller(model, cache_len), stop=set(),
                                own_thread=False)
    got: dict[int, list[int]] = {}
    for n in range(24):
        ids = prompt(10 + n % 7, n)
        got[n] = []
        batcher.submit(Row(ids, 100 + 7 * (n % 3),
                           lambda token, end, n=n: got[n].append(token)))
    held, moved, move = [], [], ContinuousBatcher._move
    monkeypatch.setattr(ContinuousBatcher, "_move",
                        lambda self, *a: (moved.append(a), move(self, *a))[1])
    with torch.inference_mode():
        while not batcher.idle():
            batcher.turn()
            held.append(resident_fraction(batcher.cache))
    assert moved, batcher.steps  # the cursor reached the end of the cache
    # 4 rows of at most 130 positions: 9 of each head's 64 pages a row (14% of the
    # cache), and the pages free slots' steps wrote since the last 16 steps; without
    # releasing, all of it; once every row left, a page or two a head
    assert max(held) < 0.2 and held[-1] < 0.04, (max(held), held[-1])

    for n in (0, 11, 23):
        ids, new = prompt(10 + n % 7, n), 100 + 7 * (n % 3)
        assert got[n][:-1] == alone(model, ids, new, cache_len=cache_len)


def test_the_prefill_s_workspace_gives_a_job_s_pages_back_once_its_rows_are_copied() -> None:
    """A job of 3 prompts writes positions 0..78 of its 3 workspace rows (5 of each head's
    64 pages); once the batcher copied its rows out, `release` leaves the page each head
    shares with the positions past the job, so a worker does not keep the largest prompts
    it has seen between two jobs."""
    model = varied_model(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=1024)
    prefiller = Prefiller(model, 1024)  # heads of 64 as SmolLM2's: 16 positions a page
    rows = [Row(prompt(60 + 9 * n, n), 4, lambda *_: None) for n in range(3)]
    with torch.inference_mode():
        job = prefiller.start(rows)
        while not job.finished:
            prefiller.step(job, whole=True)
    assert job.length == 78
    written = resident_fraction(prefiller.workspace)
    prefiller.release(job)
    left = resident_fraction(prefiller.workspace)
    assert written == pytest.approx(5 / 64) and left == pytest.approx(1 / 64), (written, left)

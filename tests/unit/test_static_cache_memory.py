"""A KV cache takes memory for the positions written, not for its length
(serve/causal_lm/runtime/static_cache.py: `empty_cache` over `untouched_zeros`): the
prefill's workspace and the decoders' cache hold cache_len positions a row, of which a chat
prompt writes a few dozen."""

from __future__ import annotations

import os

from batcher_checks import varied_model

from compress.system.processes import pss_bytes
from serve.causal_lm.runtime.static_cache import empty_cache, position_bytes

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

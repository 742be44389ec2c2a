"""A row whose logits cannot be sampled (NaN, +inf, or every token -inf) ends alone with an
error; the rows beside it decode on as if it had not been there (serve/causal_lm/runtime/
decode.pick_tokens, server/picking.py, server/batcher.py). Before, `torch.multinomial`
raised inside the shared step and every row of the batch failed."""

from __future__ import annotations

import pytest
import torch
from batcher_checks import Collect, alone, batcher_of, prompt, varied_model

from serve.causal_lm.runtime import decode
from serve.causal_lm.runtime.decode import Sampling, pick_tokens
from serve.causal_lm.server.batcher import Row


@pytest.fixture(scope="module")
def model():
    return varied_model()


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_pick_tokens_marks_a_row_it_cannot_pick_from_and_picks_the_others(poison) -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    if poison == float("-inf"):
        logits[1] = poison  # every token masked
    else:
        logits[1, 7] = poison
    sampling = Sampling(0.8, 0.9, 3)
    picked = pick_tokens(logits, [sampling, sampling, None],
                         [torch.Generator().manual_seed(3) for _ in range(2)] + [None])
    assert picked[1] == decode.NO_TOKEN
    assert picked[2] == logits[2].argmax() and 0 <= picked[0] < 50


def test_greedy_picks_are_argmax_first_of_ties_and_unusable_rows_are_marked() -> None:
    """pick_tokens' one pass (`max`) picks what `argmax` does, the first of equal maxima
    included, on SmolLM2's vocabulary width, and marks exactly the rows with a NaN, a +inf
    or nothing but -inf."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randint(-3, 4, (9, 49152), generator=generator).float()  # many ties
    logits[1, :100] = float("-inf")  # some tokens masked: still usable
    logits[2, 30000] = float("nan")
    logits[3, 5] = float("inf")
    logits[4] = float("-inf")
    logits[5, 40000] = logits[5, 12] = 9.0  # a tie at the top
    picked = pick_tokens(logits, [None] * 9, [None] * 9)
    unusable = {2, 3, 4}
    for row in range(9):
        expected = decode.NO_TOKEN if row in unusable else int(logits[row].argmax())
        assert int(picked[row]) == expected, row
    assert int(picked[5]) == 12


def test_a_row_with_nan_logits_ends_alone_with_an_error(model) -> None:
    batcher = batcher_of(model)
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=7)
    bad, good, sampled = Collect(), Collect(), Collect()
    rows = [Row(prompt(5, 1), 12, bad.emit, Sampling(0.7, 1.0, 1)),
            Row(prompt(6, 2), 12, good.emit),
            Row(prompt(4, 3), 12, sampled.emit, sampling)]
    poisoned = {"steps": 0}
    for decoder in batcher.decoders.values():
        def step(*args, _step=decoder.decode_step, **kwargs):
            logits = _step(*args, **kwargs)
            poisoned["steps"] += 1
            if poisoned["steps"] >= 3 and rows[0] in batcher.slots:
                logits[batcher.slots.index(rows[0])] = float("nan")
            return logits
        decoder.decode_step = step
    batcher.submit_all(rows)
    assert (good.wait(), sampled.wait()) == ("length", "length")
    end = bad.wait()
    assert end.startswith("error: ") and "logits" in end, end
    assert good.tokens == alone(model, rows[1].ids, 12)
    assert sampled.tokens == alone(model, rows[2].ids, 12, sampling)
    assert 0 < len(bad.tokens) < 12 and all(t >= 0 for t in bad.tokens)

"""A TorchServe batch's text rows in forward passes of similar length
(`serve.batching.length_buckets` / `by_length`): every row in exactly one pass, the cut the
cheapest there is, and the answers back in the rows' order."""

from __future__ import annotations

import itertools
import random

from serve.batching import MAX_PASS_ROWS, by_length, length_buckets


def cost(lengths: list[int], passes: list[list[int]], overhead: int) -> int:
    """Padded tokens of work of the passes, each counted with its fixed cost."""
    return sum(overhead + len(p) * max(lengths[k] for k in p) for p in passes)


def cheapest(lengths: list[int], overhead: int) -> int:
    """The least cost over every cut of the rows sorted by length (brute force)."""
    ordered = sorted(range(len(lengths)), key=lengths.__getitem__)
    best = None
    for cuts in itertools.product((False, True), repeat=len(lengths) - 1):
        passes, start = [], 0
        for k, cut in enumerate(cuts, start=1):
            if cut:
                passes.append(ordered[start:k])
                start = k
        passes.append(ordered[start:])
        spent = cost(lengths, passes, overhead)
        best = spent if best is None else min(best, spent)
    return best


def test_every_row_is_in_one_pass_and_the_cut_is_the_cheapest() -> None:
    chance = random.Random(0)
    for _ in range(200):
        lengths = [chance.randint(3, 120) for _ in range(chance.randint(1, 9))]
        overhead = chance.choice([0, 8, 32, 200])
        passes = length_buckets(lengths, overhead)
        assert sorted(k for p in passes for k in p) == list(range(len(lengths)))
        assert cost(lengths, passes, overhead) == cheapest(lengths, overhead)
        longest = [max(lengths[k] for k in p) for p in passes]
        assert longest == sorted(longest)  # shortest pass first


def test_short_rows_leave_a_long_one_and_equal_rows_stay_together() -> None:
    lengths = [9, 120, 11, 8, 10]
    assert length_buckets(lengths, 32) == [[3, 0, 4, 2], [1]]
    assert length_buckets([17] * 40, 32) == [list(range(40))]
    assert [len(p) for p in length_buckets([17] * 100, 32)] == [36, MAX_PASS_ROWS]
    assert length_buckets(lengths, 10_000) == [[3, 0, 4, 2, 1]]  # a pass costs too much


def test_answers_come_back_in_the_rows_order() -> None:
    rows = [[[1] * n, [1] * n] for n in (5, 40, 6, 41, 5)]
    seen = []

    def run(part: list) -> list[int]:
        seen.append(len(part))
        return [len(row[0]) for row in part]

    assert by_length(rows, run) == [5, 40, 6, 41, 5]
    assert sorted(seen) == [2, 3]

"""benchmarks/causal_lm/schema_pressure.py without servers: the schema it sends is the
largest under the archive's bound, and its text changes from request to request at one
length (so that every one compiles)."""

from __future__ import annotations

import json

import pytest

from benchmarks.causal_lm.schema_pressure import branches_within, wide_schema


@pytest.mark.parametrize("bound", [200, 4_000, 32_000])
def test_the_schema_is_the_largest_within_the_bound(bound: int) -> None:
    tag = "k000000_"
    branches = branches_within(bound, tag)
    assert len(json.dumps(wide_schema(branches, tag))) <= bound
    assert len(json.dumps(wide_schema(branches + 1, tag))) > bound


def test_each_request_has_its_own_text_at_one_length() -> None:
    texts = {json.dumps(wide_schema(50, f"k{k:06d}_")) for k in range(3)}
    assert len(texts) == 3 and len({len(t) for t in texts}) == 1

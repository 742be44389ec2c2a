"""Fresh-process benchmarking of a finished run, and the text sequence-length sweep."""

from __future__ import annotations

import pytest

from compress.recipe.schema import LatencyConfig

pytest.importorskip("onnxruntime")


def test_seq_lens_are_validated_and_left_out_of_dumps_when_unset() -> None:
    assert "seq_lens" not in LatencyConfig().model_dump(mode="json")  # cache keys unchanged
    assert LatencyConfig(seq_lens=[16, 32]).model_dump()["seq_lens"] == [16, 32]
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        LatencyConfig(seq_lens=[0])



"""lm-eval's `compress` model (compress/families/causal_lm/evaluation_harness.py) refuses a folder
that is no causal-LM export in one line, and is registered beside lm-eval's own models;
tests/serving/test_causal_lm_openai_features.py scores a real export with it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.registry import get_model  # noqa: E402

from compress.families.causal_lm.evaluation_harness import CompressLM  # noqa: E402


def test_compress_is_an_lm_eval_model_beside_lm_evals_own() -> None:
    assert get_model("compress") is CompressLM
    assert get_model("local-completions").__name__ == "LocalCompletionsAPI"


def test_a_folder_that_is_no_export_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a causal-LM export folder") as refused:
        CompressLM.create_from_arg_string(f"folder={tmp_path}")
    assert "\n" not in str(refused.value)

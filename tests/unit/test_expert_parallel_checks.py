"""expert_parallel's torch-free pieces: which splits of a config (or of a moefy stage's
experts) work, and the shipped runtime's collective record read into the communication
telemetry."""

from __future__ import annotations

from pathlib import Path

from compress.distributed.comm import KINDS, step_of_record
from serve.causal_lm.runtime.expert_dispatch import CommRecord
from serve.causal_lm.runtime.expert_parallel import split_problem

MIXTRAL = {"model_type": "mixtral", "num_local_experts": 4}
QWEN = {"model_type": "qwen2_moe", "num_experts": 60}


def test_a_split_must_divide_the_experts_of_a_mixture_of_experts_model() -> None:
    assert split_problem(MIXTRAL, 2) is None and split_problem(MIXTRAL, 4) is None
    assert split_problem(QWEN, 3) is None
    assert split_problem(MIXTRAL, 3) == ("expert_parallel: 3 does not divide the model's 4 "
                                         "experts per layer; use a divisor of 4")
    dense = split_problem({"model_type": "llama", "intermediate_size": 64}, 2)
    assert dense is not None and dense.startswith(
        "expert_parallel: the model (llama) has no mixture-of-experts layers")


def test_the_runtime_record_becomes_a_step_of_the_telemetry() -> None:
    record = CommRecord()
    record.add("all_to_all", 0.002, 1000)
    record.add("all_to_all", 0.001, 500)
    record.add("all_gather", 0.001, 256)
    taken = record.take()
    assert taken["all_to_all"] == {"s": 0.003, "bytes": 1500, "calls": 2}
    assert record.take() == {}  # afresh
    per_step = {k: {"s_per_step": v["s"] / 3, "bytes_per_step": v["bytes"] / 3}
                for k, v in taken.items()}
    step = step_of_record(per_step)
    assert "all_to_all" in KINDS and set(step.by_kind) == {"all_to_all", "all_gather"}
    assert step.nbytes == 1756 // 3
    assert abs((step.seconds or 0) - 0.004 / 3) < 1e-12
    assert abs(step.share(0.004 / 3 * 2) - 0.5) < 1e-9


def test_the_experts_a_moefy_stage_makes_are_checked_without_a_config() -> None:
    import pytest

    from compress.errors import UserError
    from compress.recipe.schema import load_recipe

    recipe = Path(__file__).resolve().parents[2] / "recipes/llm_moe_ep.yaml"
    assert load_recipe(recipe).stages[2].expert_parallel == 2  # 8 experts: fine
    with pytest.raises(UserError) as refused:
        load_recipe(recipe, ["stages.0.experts=3"])
    assert ("stages.2.expert_parallel: 2 does not divide the model's 3 experts per layer; "
            "use a divisor of 3 (made by the moefy stage)") in str(refused.value)

"""serve/causal_lm/runtime/leader_call.py: what rank 0 of a served split model sends the other
ranks before a generation is int64 tensors that decode to exactly its call (64-bit seeds,
float64 temperatures, None kept apart from empty), never a pickle; a payload that is not one
is refused."""

from __future__ import annotations

import pytest
import torch

from serve.causal_lm.runtime import leader_call
from serve.causal_lm.runtime.decode import Sampling
from serve.causal_lm.runtime.leader_call import LeaderCall

CALLS = [
    LeaderCall([[1, 2, 3]], [8]),
    LeaderCall([[5], [6, 7], []], [1, 2, 3], set(), None, 3),
    LeaderCall([[9, 10], [11]], [4, 4], {2, 0, 50256},
               [None, Sampling(0.7, 0.9, 2**64 - 1)], 2),
    LeaderCall([[1]], [16], None, [Sampling(1e-300, 0.1 + 0.2, 0)]),
    LeaderCall([[1], [2]], [1, 1], {3}, [Sampling(0.9, 1.0, None), Sampling()]),
]


@pytest.mark.parametrize("call", CALLS)
def test_a_call_survives_the_tensor_encoding_exactly(call: LeaderCall) -> None:
    payload = leader_call.encode(call)
    assert payload.dtype == torch.int64 and payload.dim() == 1
    assert leader_call.decode(payload) == call


def test_generate_s_arguments_become_a_call_of_one_limit_a_row() -> None:
    made = LeaderCall.of(torch.tensor([[4, 5], [6, 7]]), 3, {1}, [None, Sampling(0.5)])
    assert made == LeaderCall([[4, 5], [6, 7]], [3, 3], {1}, [None, Sampling(0.5)])
    assert LeaderCall.of(((1,), (2, 3)), (4, 5)).max_new_tokens == [4, 5]


def test_a_payload_that_is_not_a_call_is_refused() -> None:
    good = leader_call.encode(CALLS[2])
    with pytest.raises(RuntimeError, match="not a version-1 message"):
        leader_call.decode(torch.tensor([7, 1, 1, -1, 0], dtype=torch.int64))
    with pytest.raises(RuntimeError, match="where the header says"):
        leader_call.decode(good[:-1])
    with pytest.raises(RuntimeError, match="where the header says"):
        leader_call.decode(torch.cat([good, good[:1]]))
    with pytest.raises(ValueError, match="2 prompts, 1 limits"):
        leader_call.encode(LeaderCall([[1], [2]], [1]))


def test_seeds_keep_their_64_bits() -> None:
    for seed in (0, 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1):
        bits = leader_call.seed_bits(seed)
        assert -(2**63) <= bits < 2**63 and leader_call.seed_of(bits) == seed

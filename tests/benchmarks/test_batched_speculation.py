"""benchmarks/causal_lm/micro/batched_speculation.py: closed-loop clients through a batcher
(every prompt answered, as many at once as there are clients, the answers a plain batcher's),
and the `always` plan verifying wherever a draft is found."""

from __future__ import annotations

from batcher_checks import alone, batcher_of, varied_model

from benchmarks.causal_lm.micro.batched_speculation import Always, serve_set


def test_closed_loop_clients_get_every_answer_and_always_verifies() -> None:
    model = varied_model()
    phrase = [5, 17, 3, 9, 41]
    prompts = [phrase * 3, [8, 2, 44], phrase[::-1] * 2, [7, 7, 1, 30]]
    busiest = []
    batcher = batcher_of(model, speculate=3, own_thread=False)
    turn = batcher.turn

    def counting() -> None:
        busiest.append(batcher.busy())
        turn()

    batcher.turn = counting
    rate, answers = serve_set(batcher, prompts, clients=2, new=10)
    assert rate > 0 and [len(a) for a in answers] == [10] * 4
    assert answers == [alone(model, p, 10) for p in prompts]
    assert max(busiest) == 2  # never more rows than clients

    always = batcher_of(model, speculate=3, own_thread=False)
    always.__class__ = Always
    _, again = serve_set(always, prompts, clients=2, new=10)
    assert again == answers and always.verifications > 0
    assert always._cost(2, 3) < always._cost(2, 0)  # more drafts always look cheaper

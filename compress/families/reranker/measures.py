"""What a reranker's figures are: how well its scores order each query's documents by their
relevance labels (nDCG@10, MRR@10), and how close its ordering and scores stay to the float
model's (Kendall's tau per query, largest score difference). Plain lists and tensors in,
numbers out; `groups` gives each pair's query (pairs of one query share a group id)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# two documents whose reference scores differ by at most this are a near-tie: their order is
# not counted by Kendall's tau (a random-init model's scores sit within 1e-4 of each other,
# where int8 rounding reorders them without changing anything a user sees)
TIE_MARGIN = 1e-3


def query_groups(groups: Sequence[int]) -> list[list[int]]:
    """The pair indexes of each query, queries in order of first appearance."""
    order: dict[int, list[int]] = {}
    for index, group in enumerate(groups):
        order.setdefault(group, []).append(index)
    return list(order.values())


def ranked(scores: Sequence[float]) -> list[int]:
    """Positions by descending score (ties: in stored order)."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def ndcg_at_k(scores: Sequence[float], labels: Sequence[float], k: int = 10) -> float | None:
    """nDCG@k of one query: gains 2^label - 1 discounted by log2(rank + 1), over the ideal
    order's; None when no document is relevant (the query is not counted)."""
    def dcg(order: list[int]) -> float:
        return sum((2 ** labels[i] - 1) / math.log2(rank + 2)
                   for rank, i in enumerate(order[:k]))

    ideal = dcg(sorted(range(len(labels)), key=lambda i: -labels[i]))
    return None if ideal <= 0 else dcg(ranked(scores)) / ideal


def mrr_at_k(scores: Sequence[float], labels: Sequence[float], k: int = 10) -> float | None:
    """1 / the rank of the first relevant document within the top k (0 if none there);
    None when no document is relevant."""
    if not any(label > 0 for label in labels):
        return None
    for rank, i in enumerate(ranked(scores)[:k]):
        if labels[i] > 0:
            return 1.0 / (rank + 1)
    return 0.0


def kendall_tau(scores: Sequence[float], reference: Sequence[float],
                margin: float = TIE_MARGIN) -> float | None:
    """Kendall's tau of one query's scores against the reference's: over the pairs of
    documents whose reference scores differ by more than `margin`, (concordant - discordant)
    / counted, a pair concordant when this model orders it the same way (an exact tie in
    this model's scores is discordant); None when no pair is counted."""
    concordant = counted = 0
    for i in range(len(scores)):
        for j in range(i + 1, len(scores)):
            want = reference[i] - reference[j]
            if abs(want) <= margin:
                continue
            counted += 1
            concordant += (scores[i] - scores[j]) * want > 0
    return None if not counted else (2 * concordant - counted) / counted


def mean_over_queries(values: list[float | None]) -> float | None:
    counted = [v for v in values if v is not None]
    return round(sum(counted) / len(counted), 6) if counted else None


def ranking_quality(scores: torch.Tensor, labels: Sequence[float], groups: Sequence[int],
                    k: int = 10) -> dict[str, float]:
    """Mean nDCG@k and MRR@k over the queries with a relevant document."""
    values = scores.tolist()
    per_query = [([values[i] for i in idx], [labels[i] for i in idx])
                 for idx in query_groups(groups)]
    out = {f"ndcg_at_{k}": mean_over_queries([ndcg_at_k(s, y, k) for s, y in per_query]),
           f"mrr_at_{k}": mean_over_queries([mrr_at_k(s, y, k) for s, y in per_query])}
    return {key: value for key, value in out.items() if value is not None}


def agreement(scores: torch.Tensor, reference: torch.Tensor, groups: Sequence[int],
              margin: float = TIE_MARGIN) -> dict[str, float]:
    """Kendall's tau against the reference scores, per query then averaged over the queries
    with a counted pair, and the largest absolute score difference."""
    ours, theirs = scores.tolist(), reference.tolist()
    taus = [kendall_tau([ours[i] for i in idx], [theirs[i] for i in idx], margin)
            for idx in query_groups(groups)]
    out = {"score_max_abs_diff": float((scores.float() - reference.float()).abs().max())}
    tau = mean_over_queries(taus)
    if tau is not None:
        out["kendall_tau"] = tau
    return out


def pearson(scores: torch.Tensor, reference: torch.Tensor) -> float | None:
    """Pearson's correlation of all the pairs' scores with the reference's (across queries:
    a student that keeps the teacher's scale as well as its order gets near 1); None when
    either side is constant."""
    ours, theirs = scores.double().flatten(), reference.double().flatten()
    ours, theirs = ours - ours.mean(), theirs - theirs.mean()
    norm = float(ours.norm() * theirs.norm())
    return None if norm == 0 else round(float((ours * theirs).sum()) / norm, 6)

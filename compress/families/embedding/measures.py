"""What an embedding model's figures are: how close its embeddings stay to the float
model's (fidelity), whether each text keeps its neighbours (retrieval agreement), and how
well the labels can be read from them (k-NN accuracy). Plain tensors in, numbers out."""

from __future__ import annotations

import torch
from torch import nn


def fidelity(embeddings: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """Cosine between each row and the reference model's row for the same text: the mean,
    and the 1st percentile (the worst texts)."""
    cosine = nn.functional.cosine_similarity(embeddings.float(), reference.float(), dim=-1)
    return {"fidelity": round(float(cosine.mean()), 6),
            "fidelity_p1": round(float(torch.quantile(cosine, 0.01)), 6)}


def neighbours(embeddings: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's `k` nearest other rows by cosine (rows x k indexes)."""
    unit = nn.functional.normalize(embeddings.float(), dim=-1)
    similarity = unit @ unit.T
    similarity.fill_diagonal_(float("-inf"))  # a text is not its own neighbour
    return similarity.topk(min(k, len(unit) - 1), dim=-1).indices


def recall_at_k(embeddings: torch.Tensor, reference: torch.Tensor, k: int = 10) -> float:
    """Of each text's `k` nearest texts under the reference model, the share that are
    also among its `k` nearest under this one (1.0: retrieval unchanged)."""
    ours, theirs = neighbours(embeddings, k), neighbours(reference, k)
    hits = [len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ours, theirs, strict=True)]
    return round(sum(hits) / (len(hits) * ours.shape[1]), 6)


def knn_accuracy(embeddings: torch.Tensor, labels: torch.Tensor, k: int = 5) -> float:
    """Leave-one-out k-NN accuracy: each text labelled by the majority of its `k` nearest
    others (ties: the nearest's label)."""
    nearest = neighbours(embeddings, k)
    votes = labels[nearest]  # rows x k
    picked = []
    for row in votes:
        counts = torch.bincount(row, minlength=int(labels.max()) + 1)
        best = counts.max()
        picked.append(next(int(v) for v in row if counts[v] == best))  # nearest of the tied
    return round(float((torch.tensor(picked) == labels).float().mean()), 6)


def widths_to_measure(width: int, declared: tuple[int, ...] | list[int], matryoshka: bool
                      ) -> list[int]:
    """The shorter widths a Matryoshka model is measured at: its declared widths below
    `width`, else (declared Matryoshka, no widths said) halvings of the width down to 32;
    [] for a model not trained to be cut."""
    if not matryoshka:
        return []
    if declared:
        return sorted({d for d in declared if 0 < d < width}, reverse=True)
    halves, d = [], width // 2
    while d >= 32:
        halves.append(d)
        d //= 2
    return halves


def quality_at_widths(embeddings: torch.Tensor, reference: torch.Tensor, widths: list[int],
                      k: int = 10) -> dict[str, float]:
    """Each width's fidelity (cosine between the cut embedding and the reference cut alike)
    and recall@k (each text's neighbours under the cut embedding among its neighbours under
    the whole reference: what cutting costs, measured on the reference model itself too)."""
    out: dict[str, float] = {}
    for width in widths:
        out[f"fidelity_d{width}"] = fidelity(embeddings[:, :width],
                                             reference[:, :width])["fidelity"]
        out[f"recall_at_{k}_d{width}"] = recall_at_k(embeddings[:, :width], reference, k)
    return out

"""Stage `search` on a reranker: the shared search (every candidate runtime and precision,
float fallback layers, smaller students, finalists re-timed) held to a ranking budget:
Kendall's tau per query against the float model's scores (`min_kendall_tau`) and the nDCG@10
points lost against the float model's (`max_ndcg_drop`), either or both. Among trials as
fast as each other the higher nDCG@10 wins.

The budget counts from the float model the run started from (its scores of the eval pairs,
`reranker_reference.safetensors`, written by the baseline), not from the model that enters
the stage: after a distillation or a prune, what a user is promised is closeness to the
model they gave. Layers are ranked for float fallback by the squared score difference int8
causes (a one-score head has no distribution for a KL), and shapes are distilled from the
entering model's score logits (`distillation.py`; no labels are read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from compress.algorithms.sensitivity import Divergence
from compress.data.datasets import DataBundle
from compress.families.reranker.distillation import as_reranker, classifier_view, make_loss_fn
from compress.families.reranker.family import RANK_K, quality, reference_scores, score
from compress.families.reranker.measures import ranking_quality
from compress.families.reranker.pairs import groups_of
from compress.families.reranker.stages.export import served_facts
from compress.models.bundle import ModelBundle
from compress.recipe.kinds.search import SearchConfig, ShapeSpec, ShapeTraining
from compress.runfolder.files import sha256_json
from compress.search import shapes
from compress.search.quality import points
from compress.search.stage import Search, run_search
from compress.stages.context import StageContext, State

NDCG, MRR = f"ndcg_at_{RANK_K}", f"mrr_at_{RANK_K}"
TAU = "kendall_tau"
SCORE_DIFFERENCE = Divergence(
    "squared score difference", "the squared difference between the score and the float "
    "model's", lambda out: out.float().reshape(-1),
    lambda got, want: float((got - want).pow(2).sum()))


class RankingBudget:
    """A reranker's quality: Kendall's tau against the float model's scores at least
    `min_tau`, nDCG@10 at most `max_drop` points below the float model's; MRR@10 beside
    them. A trial whose every pair of documents is a near-tie in the float model (no tau)
    is not held to `min_tau`."""

    key, label, scale = NDCG, "nDCG@10 (%)", 100.0
    against = "the float model"
    loosen = "lower min_kendall_tau or raise max_ndcg_drop"
    worse = "ranks worse"

    def __init__(self, data: DataBundle, recipe, entering: ModelBundle, run_dir: Path,
                 min_tau: float | None, max_drop: float | None):
        self.data, self.recipe, self.entering = data, recipe, entering
        self.examples = data.splits["eval"]
        self.run_dir = run_dir
        self.min_tau, self.max_drop = min_tau, max_drop
        self.budget = ", ".join(f"{name} {value:g}" for name, value in (
            ("min_kendall_tau", min_tau), ("max_ndcg_drop", max_drop)) if value is not None)
        self._float: torch.Tensor | None = None
        self._float_ndcg: float | None = None
        self._fingerprint: str | None = None

    def float_scores(self) -> torch.Tensor:
        """The float model's scores of the eval pairs: the run's reference, else the
        entering model's (a run whose baseline was not measured)."""
        if self._float is None:
            self._float = reference_scores(self.run_dir)
        if self._float is None:
            self._float = self.score(self.entering)
        return self._float

    def float_ndcg(self) -> float:
        """The float model's nDCG@10 on the eval pairs (what `max_ndcg_drop` counts from)."""
        if self._float_ndcg is None:
            figures = ranking_quality(self.float_scores(), self.examples.labels,
                                      groups_of(self.examples), RANK_K)
            self._float_ndcg = figures.get(NDCG, 0.0)
        return self._float_ndcg

    def score(self, bundle: ModelBundle) -> torch.Tensor:
        return score(bundle.model, self.examples, self.recipe.evaluation.batch_size,
                     bundle.tokenizer, self.data.max_length)

    def settings(self) -> dict[str, Any]:
        if self._fingerprint is None:  # every trial's key asks
            self._fingerprint = sha256_json(self.float_scores()[::7].tolist())
        return {"float_scores": self._fingerprint}

    def measure(self, bundle: ModelBundle, reference: dict[str, Any] | None
                ) -> dict[str, Any]:
        return quality(self.score(bundle), self.float_scores(), self.examples)

    def judge(self, record: dict[str, Any], reference: dict[str, Any]) -> None:
        record["ndcg_drop"] = round(100 * (self.float_ndcg() - record.get(NDCG, 0.0)), 3)
        gaps = [0.0]  # in tau units and nDCG fractions: the closest trial's distance
        if self.min_tau is not None and record.get(TAU) is not None:
            gaps.append(self.min_tau - record[TAU])
        if self.max_drop is not None:
            gaps.append((record["ndcg_drop"] - self.max_drop) / 100)
        record["shortfall"] = round(max(gaps), 6)
        record["within"] = all(gap <= 1e-9 for gap in gaps)

    def value(self, record: dict[str, Any]) -> str:
        tau = record.get(TAU)
        return (f"nDCG@10 {record.get(NDCG, 0):.4f}"
                + ("" if tau is None else f", Kendall's tau {tau:.3f}"))

    def line(self, record: dict[str, Any]) -> str:
        verdict = "within" if record["within"] else "outside"
        return (f"{self.value(record)} ({points(record['ndcg_drop'])} pt), "
                f"MRR@10 {record.get(MRR, 0):.4f} ({verdict} {self.budget})")

    def outside(self, record: dict[str, Any]) -> str:
        problems = []
        if self.min_tau is not None and record.get(TAU) is not None \
                and record[TAU] < self.min_tau:
            problems.append(f"Kendall's tau {record[TAU]:.4f} < min_kendall_tau {self.min_tau:g}")
        if self.max_drop is not None and record["ndcg_drop"] > self.max_drop:
            problems.append(f"loses {record['ndcg_drop']:.2f} nDCG@10 pt > max_ndcg_drop "
                            f"{self.max_drop:g}")
        return "; ".join(problems)

    def gap(self, record: dict[str, Any]) -> str:
        return self.value(record)

    def columns(self) -> list[tuple[str, str]]:
        return [("nDCG@10", NDCG), ("Δ pt", "ndcg_drop"), ("MRR@10", MRR), ("tau", TAU)]

    def cell(self, record: dict[str, Any], key: str) -> str:
        if record.get(key) is None:
            return ""
        return points(record[key]) if key == "ndcg_drop" else f"{record[key]:.4f}"

    def headline(self, reference: dict[str, Any]) -> str:
        entering = (f"; the entering model: nDCG@10 {reference[NDCG]:.4f}"
                    if NDCG in reference else "")
        return (f"within {self.budget} of the float model (nDCG@10 "
                f"{self.float_ndcg():.4f}){entering}")

    def summary(self, reference: dict[str, Any], winner: dict[str, Any] | None
                ) -> dict[str, Any]:
        out: dict[str, Any] = {"search_min_kendall_tau": self.min_tau,
                               "search_max_ndcg_drop": self.max_drop,
                               "search_float_ndcg_at_10": round(self.float_ndcg(), 6),
                               "search_reference_ndcg_at_10": reference.get(NDCG)}
        if winner:
            out.update({k: winner[k] for k in (NDCG, MRR, TAU, "score_max_abs_diff")
                        if k in winner}, search_ndcg_drop=winner["ndcg_drop"])
            if winner.get("real_items_per_s_b32"):
                out["real_items_per_s_b32"] = winner["real_items_per_s_b32"]
        return out

    def floor(self, reference: dict[str, Any]) -> float | None:
        return None if self.max_drop is None else self.float_ndcg() - self.max_drop / 100


def train_shape(teacher: ModelBundle, spec: ShapeSpec, training: ShapeTraining,
                setup: shapes.Setup, folder: Path, log) -> tuple[ModelBundle, dict[str, Any]]:
    """A smaller cross-encoder: the shared shape (`spec.layers` evenly spaced layers, then
    neurons or heads removed with recovery) trained on the entering model's score logits;
    `teacher` is left as it was."""
    view = classifier_view(teacher)
    student, figures = shapes.train_shape(view, spec, training, setup, folder, log,
                                          loss_fn=make_loss_fn(view.model))
    return as_reranker(student, teacher), figures


def run(state: State, cfg: SearchConfig, ctx: StageContext) -> State:
    """Search the cross-encoder that entered the stage within the ranking budget."""
    budget = RankingBudget(ctx.data, ctx.recipe, state.bundle, ctx.run_dir,
                           cfg.min_kendall_tau, cfg.max_ndcg_drop)
    meta = {"outputs": ["score"], "reranker": served_facts(ctx)}
    return run_search(Search(state, cfg, ctx, budget, train_shape, SCORE_DIFFERENCE, meta))

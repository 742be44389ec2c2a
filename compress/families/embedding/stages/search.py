"""Stage `search` on an embedding model: the shared search (every candidate runtime and
precision, float fallback layers, smaller students, finalists re-timed) held to a fidelity
and recall budget instead of accuracy points.

The budget counts from the float model the run started from (its embeddings of the eval
texts, `embedding_reference.safetensors`, written by the baseline), not from the model that
enters the stage: after a distillation, what a user is promised is closeness to the model
they gave. Layers are ranked for float fallback by the cosine distance int8 causes, and
shapes are distilled from the entering model's embeddings (no labels are read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from compress.algorithms.distill import encoder_layers, evenly_spaced, student_from_layers
from compress.algorithms.sensitivity import COSINE
from compress.data.datasets import DataBundle
from compress.families.embedding.family import RECALL_K, REFERENCE, embed, quality
from compress.families.embedding.stages.distill import make_loss_fn
from compress.families.embedding.stages.export import served_facts
from compress.models.bundle import ModelBundle
from compress.recipe.kinds.search import SearchConfig, ShapeSpec, ShapeTraining
from compress.recipe.options import TrainOptions
from compress.runfolder.files import sha256_json
from compress.search.shapes import Setup, prune_shape
from compress.search.stage import Search, run_search
from compress.stages.context import StageContext, State

RECALL = f"recall_at_{RECALL_K}"


class EmbeddingBudget:
    """An embedding model's quality: fidelity (mean cosine to the float model's embeddings)
    at least `min_fidelity`, recall@10 of the float model's neighbours at least
    `min_recall`; k-NN accuracy beside them where the data has labels."""

    key, label, scale = "fidelity", "fidelity to the float model (mean cosine)", 1.0
    against = "the float model"
    loosen = "lower min_fidelity or min_recall_at_10"
    worse = "less faithful"

    def __init__(self, data: DataBundle, recipe, entering: ModelBundle, run_dir: Path,
                 min_fidelity: float | None, min_recall: float | None):
        self.data, self.recipe, self.entering = data, recipe, entering
        self.reference_file = run_dir / REFERENCE
        self.min_fidelity, self.min_recall = min_fidelity, min_recall
        self.budget = ", ".join(f"{name} {value:g}" for name, value in (
            ("min_fidelity", min_fidelity), ("min_recall_at_10", min_recall))
            if value is not None)
        self._float: torch.Tensor | None = None
        self._fingerprint: str | None = None

    def float_embeddings(self) -> torch.Tensor:
        """The float model's embeddings of the eval texts: the run's reference, else the
        entering model's (a run whose baseline was not measured)."""
        if self._float is None:
            if self.reference_file.is_file():
                from safetensors.torch import load_file

                self._float = load_file(str(self.reference_file))["embeddings"]
            else:
                self._float = self.embed(self.entering)
        return self._float

    def embed(self, bundle: ModelBundle) -> torch.Tensor:
        return embed(bundle.model, self.data.splits["eval"],
                     self.recipe.evaluation.batch_size, bundle.tokenizer, self.data.max_length)

    def settings(self) -> dict[str, Any]:
        if self._fingerprint is None:  # every trial's key asks
            sample = self.float_embeddings().flatten()[::97].tolist()
            self._fingerprint = sha256_json(sample)
        return {"float_embeddings": self._fingerprint}

    def measure(self, bundle: ModelBundle, reference: dict[str, Any] | None
                ) -> dict[str, Any]:
        return quality(self.embed(bundle), self.float_embeddings(),
                       self.data.splits["eval"].labels)

    def judge(self, record: dict[str, Any], reference: dict[str, Any]) -> None:
        gaps = [least - record[key] for key, least in (("fidelity", self.min_fidelity),
                                                       (RECALL, self.min_recall))
                if least is not None]
        record["shortfall"] = round(max(gaps), 6)
        record["within"] = record["shortfall"] <= 1e-9

    def value(self, record: dict[str, Any]) -> str:
        return f"fidelity {record['fidelity']:.4f}, recall@10 {record[RECALL]:.3f}"

    def line(self, record: dict[str, Any]) -> str:
        verdict = "within" if record["within"] else "outside"
        knn = f", k-NN {record['knn_accuracy']:.3f}" if "knn_accuracy" in record else ""
        return (f"fidelity {record['fidelity']:.4f} (p1 {record['fidelity_p1']:.3f}), "
                f"recall@10 {record[RECALL]:.3f}{knn} ({verdict} {self.budget})")

    def outside(self, record: dict[str, Any]) -> str:
        return "; ".join(f"{name} {record[key]:.4f} < {budget} {least:g}"
                         for key, name, budget, least in (
                             ("fidelity", "fidelity", "min_fidelity", self.min_fidelity),
                             (RECALL, "recall@10", "min_recall_at_10", self.min_recall))
                         if least is not None and record[key] < least)

    def gap(self, record: dict[str, Any]) -> str:
        return self.value(record)

    def columns(self) -> list[tuple[str, str]]:
        return [("fidelity", "fidelity"), ("p1", "fidelity_p1"), ("recall@10", RECALL),
                ("k-NN acc", "knn_accuracy")]

    def cell(self, record: dict[str, Any], key: str) -> str:
        return "" if record.get(key) is None else f"{record[key]:.4f}"

    def headline(self, reference: dict[str, Any]) -> str:
        entering = (f"; the entering model: fidelity {reference['fidelity']:.4f}"
                    if "fidelity" in reference else "")
        return f"within {self.budget} of the float model{entering}"

    def summary(self, reference: dict[str, Any], winner: dict[str, Any] | None
                ) -> dict[str, Any]:
        out: dict[str, Any] = {"search_min_fidelity": self.min_fidelity,
                               "search_min_recall_at_10": self.min_recall,
                               "search_reference_fidelity": reference.get("fidelity")}
        if winner:
            out.update({k: winner[k] for k in ("fidelity", "fidelity_p1", RECALL,
                                               "knn_accuracy") if k in winner})
            if winner.get("real_items_per_s_b32"):
                out["real_items_per_s_b32"] = winner["real_items_per_s_b32"]
        return out

    def floor(self, reference: dict[str, Any]) -> float | None:
        return self.min_fidelity


def train_shape(teacher: ModelBundle, spec: ShapeSpec, training: ShapeTraining,
                setup: Setup, folder: Path, log) -> tuple[ModelBundle, dict[str, Any]]:
    """A smaller encoder: `spec.layers` evenly spaced layers of `teacher` distilled from its
    embeddings (|s - t|^2 + 1 - cos), then neurons or heads removed with recovery towards
    the same embeddings; `teacher` is left as it was."""
    total = len(encoder_layers(teacher.model))
    figures: dict[str, Any] = {"teacher_layers": total}
    student = student_from_layers(teacher, evenly_spaced(spec.layers or total, total))
    options = TrainOptions(**training.model_dump(
        exclude={"temperature", "alpha", "layerwise", "recovery"}))
    loss_fn = make_loss_fn(teacher.model)
    if spec.layers is not None:
        log(f"distilling {spec.layers} of {total} layers from the embeddings")
        result = setup(folder / "checkpoints" / "distill", f"{spec.label} distill").run(
            student.model, options, student.tokenizer, loss_fn=loss_fn)
        figures.update(distill_steps=result.steps, distill_loss=result.final_loss)
    return student, prune_shape(student, spec, training, setup, folder, log, figures,
                                loss_fn)


def run(state: State, cfg: SearchConfig, ctx: StageContext) -> State:
    """Search the encoder that entered the stage within the fidelity and recall budget."""
    budget = EmbeddingBudget(ctx.data, ctx.recipe, state.bundle, ctx.run_dir,
                             cfg.min_fidelity, cfg.min_recall_at_10)
    meta = {"outputs": ["embedding"], "embedding": served_facts(ctx)}
    return run_search(Search(state, cfg, ctx, budget, train_shape, COSINE, meta))

"""How a search judges what a trial keeps: a `Quality` measures each model's quality
figures, says whether a trial is within the stage's budget and why not, and names the
columns the report shows. A family supplies its own (a classifier counts accuracy points
against the entering model, `AccuracyDrop`; an embedding model counts fidelity and recall
against the float model, `compress.families.embedding.stages.search`); the search, the choice of
the winner and the report are the same for every family."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from compress.data.datasets import DataBundle
from compress.measure.evaluate import classification_metrics, predict
from compress.models.bundle import ModelBundle


class Quality(Protocol):
    """What a search needs from a family to judge its trials."""

    key: str  # the figure the search ranks quality by, higher is better
    label: str  # how the report and the plot name it
    scale: float  # the plot shows `key` times this
    budget: str  # the stage's budget in words: "max_accuracy_drop 0.5"
    against: str  # what the budget counts from: "the entering model"
    loosen: str  # how to widen the budget: "raise max_accuracy_drop"
    worse: str  # a trial of lower quality is "less accurate"

    def settings(self) -> dict[str, Any]:
        """What the figures depend on besides the model (part of every trial's key)."""

    def measure(self, bundle: ModelBundle, reference: dict[str, Any] | None
                ) -> dict[str, Any]:
        """The quality figures of `bundle`; `reference` is the entering model's record
        (None while measuring the entering model itself)."""

    def judge(self, record: dict[str, Any], reference: dict[str, Any]) -> None:
        """Set `record["within"]` (in the budget) and `record["shortfall"]` (how far from
        it, in the budget's unit, <= 0 when within) and any figure the report shows."""

    def line(self, record: dict[str, Any]) -> str:
        """The trial's quality in a progress line."""

    def outside(self, record: dict[str, Any]) -> str:
        """Why a trial outside the budget lost."""

    def value(self, record: dict[str, Any]) -> str:
        """The trial's quality in a few words, to compare two trials."""

    def gap(self, record: dict[str, Any]) -> str:
        """Where a trial outside the budget stands, for the closest one."""

    def columns(self) -> list[tuple[str, str]]:
        """(header, record key) of the report's quality columns."""

    def cell(self, record: dict[str, Any], key: str) -> str:
        """A quality column's text for `record`."""

    def headline(self, reference: dict[str, Any]) -> str:
        """What the winner had to stay within, for the report's title."""

    def summary(self, reference: dict[str, Any], winner: dict[str, Any] | None
                ) -> dict[str, Any]:
        """The stage metrics about quality (the run's manifest and report)."""

    def floor(self, reference: dict[str, Any]) -> float | None:
        """The lowest `key` value within the budget, for the plot (None: none drawn)."""


def points(drop: float) -> str:
    """An accuracy change in points, signed (a drop of 0 is +0.00, never -0.00)."""
    return f"{-drop + 0.0:+.2f}"


class AccuracyDrop:
    """A classifier's quality: eval accuracy, at most `max_drop` points below the entering
    model's, with macro-F1 and agreement with its predictions beside it."""

    key, label, scale = "accuracy", "accuracy (%)", 100.0
    against, loosen = "the entering model", "raise max_accuracy_drop"
    worse = "less accurate"

    def __init__(self, data: DataBundle | None, recipe, max_drop: float):
        self.data, self.recipe, self.max_drop = data, recipe, max_drop
        self.budget = f"max_accuracy_drop {max_drop:g}"

    def settings(self) -> dict[str, Any]:
        return {}

    def measure(self, bundle: ModelBundle, reference: dict[str, Any] | None
                ) -> dict[str, Any]:
        eval_split = self.data.splits["eval"]
        with torch.inference_mode():
            preds = predict(bundle.model, eval_split, self.recipe.evaluation.batch_size,
                            bundle.tokenizer, self.data.max_length)
        figures = classification_metrics(preds, eval_split.labels, self.data.num_labels)
        if reference is not None:
            figures["agreement"] = round(float(
                (preds == torch.tensor(reference["preds"])).float().mean()), 6)
        figures["preds"] = preds.tolist()
        return figures

    def judge(self, record: dict[str, Any], reference: dict[str, Any]) -> None:
        record["drop"] = round(100 * (reference["accuracy"] - record["accuracy"]), 3)
        record["shortfall"] = round(record["drop"] - self.max_drop, 3)
        record["within"] = record["drop"] <= self.max_drop + 1e-9

    def line(self, record: dict[str, Any]) -> str:
        verdict = "within" if record["within"] else "outside"
        return (f"accuracy {100 * record['accuracy']:.2f}% ({points(record['drop'])} pt, "
                f"{verdict} {self.max_drop:g})")

    def outside(self, record: dict[str, Any]) -> str:
        return f"loses {record['drop']:.2f} pt > max_accuracy_drop {self.max_drop:g}"

    def value(self, record: dict[str, Any]) -> str:
        return f"{100 * record['accuracy']:.2f}%"

    def gap(self, record: dict[str, Any]) -> str:
        return f"{points(record['drop'])} pt ({self.value(record)})"

    def columns(self) -> list[tuple[str, str]]:
        return [("accuracy %", "accuracy"), ("Δ pt", "drop"), ("agreement", "agreement")]

    def cell(self, record: dict[str, Any], key: str) -> str:
        if key == "accuracy":
            return f"{100 * record['accuracy']:.2f}"
        if key == "drop":
            return points(record["drop"])
        return f"{record.get(key, 0):.4f}"

    def headline(self, reference: dict[str, Any]) -> str:
        return (f"within {self.max_drop:g} point of the entering model "
                f"({100 * reference.get('accuracy', 0):.2f}%)")

    def summary(self, reference: dict[str, Any], winner: dict[str, Any] | None
                ) -> dict[str, Any]:
        out = {"search_reference_accuracy": reference.get("accuracy"),
               "search_max_accuracy_drop": self.max_drop}
        if winner:
            out.update(search_accuracy_drop=winner["drop"], accuracy=winner["accuracy"],
                       macro_f1=winner["macro_f1"])
        return out

    def floor(self, reference: dict[str, Any]) -> float | None:
        return reference.get("accuracy", 0) - self.max_drop / 100

"""Stage kind `search`: its config and spec (no torch import; run module:
compress/search/stage.py).

The candidates: each is a way to serve the model (a precision and a runtime), built from
the stages compress already has (quantize, precision, export) into an export folder the
package stage can archive. The shapes: smaller students (distilled layers, pruned neurons
and heads) that every candidate is tried on as well.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from compress.recipe.kinds.distill import LayerwiseSpec
from compress.recipe.options import CalibrationOptions, StageName, StrictModel, TrainOptions
from compress.recipe.registry import StageSpec, register

# name -> (what it is, file format, needs a Hugging Face model, needs a bf16 CPU, quantizes)
CANDIDATES: dict[str, tuple[str, str, bool, bool, bool]] = {
    "pt2e_static_aoti": ("PT2E int8 static (calibrated) as an AOTInductor package", "aoti",
                         False, False, True),
    "pt2e_dynamic_aoti": ("PT2E int8 dynamic activations as an AOTInductor package", "aoti",
                          False, False, True),
    "pt2e_static_bf16_aoti": ("PT2E int8 static with the float ops in bf16 as an "
                              "AOTInductor package", "aoti", False, True, True),
    "pt2e_static_bf16_attention_aoti": ("PT2E int8 static as an AOTInductor package whose "
                                        "attention runs on compress's bf16 kernel", "aoti",
                                        False, True, True),
    "pt2e_static_packed_aoti": ("PT2E int8 static as an AOTInductor package that computes "
                                "a batch's real tokens only, packed into one sequence, "
                                "attention per text on compress's kernel (sentence "
                                "encoders)", "aoti", False, True, True),
    "bf16_aoti": ("bfloat16 as an AOTInductor package", "aoti", True, True, False),
    "ort_dynamic_int8": ("ONNX Runtime dynamic int8 (every MatMul)", "onnx", False, False,
                         True),
    "ort_static_int8": ("ONNX Runtime static int8 (QDQ, calibrated)", "onnx", False, False,
                        True),
    "onnx_fp32": ("float32 in ONNX Runtime", "onnx", False, False, False),
    "aoti_fp32": ("float32 as an AOTInductor package", "aoti", False, False, False),
}
Candidate = Literal["pt2e_static_aoti", "pt2e_dynamic_aoti", "pt2e_static_bf16_aoti",
                    "pt2e_static_bf16_attention_aoti", "pt2e_static_packed_aoti", "bf16_aoti",
                    "ort_dynamic_int8", "ort_static_int8", "onnx_fp32", "aoti_fp32"]
OBJECTIVES = {"latency_b1": "latency_ms_b1", "latency_b8": "latency_ms_b8",
              "latency_real": "latency_ms_b8_real", "latency_real_b32": "latency_ms_b32_real",
              "size": "bytes"}
BUDGETS = ("max_accuracy_drop", "min_fidelity", "min_recall_at_10", "min_kendall_tau",
           "max_ndcg_drop")  # quality budgets
RERANKER_BUDGETS = ("min_kendall_tau", "max_ndcg_drop")


class ShapeSpec(StrictModel):
    """A smaller student the search trains once, then tries every candidate on."""

    layers: int | None = Field(
        None, ge=1, le=1000, description="Keep this many evenly spaced layers of the entering "
        "model (unset: all of them).")
    ffn: float = Field(0.0, ge=0, lt=1, description="Share of each layer's feed-forward "
                       "neurons removed (structured pruning, then recovery training).")
    heads: float = Field(0.0, ge=0, lt=1, description="Share of each layer's attention heads "
                         "removed (structured pruning, then recovery training).")
    teacher: bool = Field(
        True, description="Distil the kept layers from the entering model; false: fine-tune "
        "them on the labels alone (the baseline distillation has to beat).")

    @model_validator(mode="after")
    def _smaller(self) -> ShapeSpec:
        if self.layers is None and not self.ffn and not self.heads:
            raise ValueError("a shape keeps fewer layers or removes ffn or heads; give layers, "
                             "ffn or heads")
        if not self.teacher and self.layers is None:
            raise ValueError("teacher: false fine-tunes kept layers on the labels; give layers")
        return self

    @property
    def label(self) -> str:
        """A short name: L3, L3-ffn50, L6-heads25, L3-direct."""
        parts = [f"L{self.layers}" if self.layers else "all"]
        parts += [f"ffn{round(100 * self.ffn)}"] if self.ffn else []
        parts += [f"heads{round(100 * self.heads)}"] if self.heads else []
        return "-".join(parts + ([] if self.teacher else ["direct"]))


class ShapeTraining(TrainOptions):
    """How each shape trains: distillation from the entering model with these options (or
    fine-tuning, for `teacher: false`), then recovery after pruning."""

    epochs: float = Field(1.0, gt=0, le=10_000, description="Passes over the train split.")
    temperature: float = Field(2.0, gt=0, le=1000, description="KL temperature.")
    alpha: float = Field(0.5, ge=0, le=1, description="Weight of cross-entropy in the KD loss.")
    layerwise: LayerwiseSpec | None = Field(
        None, description="Also match hidden states (and attention) layer by layer.")
    recovery: TrainOptions = Field(
        default_factory=lambda: TrainOptions(max_steps=150, learning_rate=5e-5),
        description="Training after structured pruning.")


class SearchConfig(StrictModel):
    """The fastest (or smallest) servable artifact within a quality budget (a classifier's
    accuracy loss, an embedding model's fidelity and recall, a reranker's Kendall's tau and
    nDCG@10 loss): every candidate precision and runtime built, measured and, when it loses
    too much, given float fallback layers by sensitivity. The winner is an export the
    package stage archives."""

    kind: Literal["search"] = "search"
    name: StageName = None
    max_accuracy_drop: float | None = Field(
        None, ge=0, le=100, description="Classifiers: largest accuracy loss in points "
        "against the model that enters the stage (required).")
    min_fidelity: float | None = Field(
        None, gt=0, le=1, description="Embedding models: lowest mean cosine between a "
        "trial's embeddings of the eval texts and the float model's (the run's baseline).")
    min_recall_at_10: float | None = Field(
        None, gt=0, le=1, description="Embedding models: lowest recall@10 of each eval "
        "text's neighbours against the float model's neighbours.")
    min_kendall_tau: float | None = Field(
        None, ge=-1, le=1, description="Rerankers: lowest Kendall's tau of a trial's scores "
        "against the float model's (the run's baseline), per query then averaged over the "
        "eval queries (near-ties of the float model, within 0.001, not counted).")
    max_ndcg_drop: float | None = Field(
        None, ge=0, le=100, description="Rerankers: largest nDCG@10 loss in points against "
        "the float model's on the eval pairs.")
    objective: Literal["latency_b1", "latency_b8", "latency_real", "latency_real_b32",
                       "size"] = Field(
        "latency_b8", description="What the winner minimises: median latency at batch 1 or "
        "8 (seq_len of evaluation.latency), at batch 8 or 32 on the eval split's own "
        "sentences (latency_real, latency_real_b32), or file size.")
    candidates: list[Candidate] | None = Field(
        None, min_length=1, description="Candidates to try (default: every one that applies "
        "to the model and this CPU).")
    max_trials: int | None = Field(
        None, ge=1, le=10_000, description="Most trials to run, fallbacks included (default: "
        "no limit).")
    time_budget_s: float | None = Field(
        None, gt=0, description="Start no new trial after this many seconds (cached trials "
        "cost nothing).")
    max_fallback_layers: int = Field(
        8, ge=0, le=1000, description="Most layers kept in float for one candidate.")
    sensitivity_samples: int = Field(
        128, ge=1, le=100_000, description="Calibration examples the layer ranking uses.")
    final_rounds: int = Field(
        3, ge=0, le=100, description="Rounds re-timing the finalists in one process, "
        "alternating, before the winner is chosen (0: pick from the trials' own timings).")
    threads: int | None = Field(
        None, ge=1, le=4096, description="Intra-op threads of every runtime (default: the "
        "latency threads).")
    calibration: CalibrationOptions = Field(default_factory=CalibrationOptions)
    smoothing: float | None = Field(
        None, ge=0.0, le=1.0, description="SmoothQuant's alpha for the PT2E static "
        "candidates (the quantize stage's `smoothing`); None: no smoothing.")
    shapes: list[ShapeSpec] | None = Field(
        None, description="Smaller students (fewer layers, fewer neurons or heads) to train "
        "and try every candidate on, cheapest to train first; the entering model is tried "
        "too (Hugging Face encoders only; needs the train split).")
    shape_training: ShapeTraining = Field(default_factory=ShapeTraining)

    @field_validator("shapes")
    @classmethod
    def _distinct_shapes(cls, value: list[ShapeSpec] | None) -> list[ShapeSpec] | None:
        if value is not None and len({s.label for s in value}) != len(value):
            raise ValueError("a shape is listed twice")
        return value

    @field_validator("candidates")
    @classmethod
    def _unique(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("a candidate is listed twice")
        return value


def not_applicable(name: str, hugging_face: bool, bf16_cpu: bool | None) -> str | None:
    """Why candidate `name` cannot serve the model (None: it can). `bf16_cpu` None: not
    known yet (validation does not probe the CPU)."""
    _, _, needs_hf, needs_bf16, _ = CANDIDATES[name]
    if needs_hf and not hugging_face:
        return "casts Hugging Face models only"
    if needs_bf16 and bf16_cpu is False:
        return "needs a CPU that computes bfloat16 natively (AVX512-BF16 or AMX)"
    return None


def _candidates_apply(recipe: Any, i: int) -> list[str]:
    """Listed candidates that cannot serve the recipe's model, and objectives it lacks."""
    from compress.recipe.sources import is_factory  # sources imports the spec registry

    cfg = recipe.stages[i]
    hugging_face = not is_factory(recipe.model.source)
    problems = []
    if cfg.objective.startswith("latency_real") and not hugging_face:
        problems.append(f"stages.{i}.objective: {cfg.objective} times the eval split's sentences "
                        f"and model.source {recipe.model.source} is not a text model; use "
                        f"latency_b1, latency_b8 or size")
    if cfg.shapes and not hugging_face:
        problems.append(f"stages.{i}.shapes: smaller students are built from a Hugging Face "
                        f"encoder's layers, and model.source {recipe.model.source} is not one; "
                        f"drop shapes")
    if cfg.candidates is not None:
        reasons = {c: not_applicable(c, hugging_face, None) for c in cfg.candidates}
        if all(reasons.values()):
            why = "; ".join(f"{c} {r}" for c, r in reasons.items())
            problems.append(f"stages.{i}.candidates: none applies to model.source "
                            f"{recipe.model.source} ({why}); list others or leave candidates "
                            f"out for every one that applies")
    return problems


def _splits(cfg: SearchConfig) -> tuple[str, ...]:
    return ("eval", "calibration", "train") if cfg.shapes else ("eval", "calibration")


def export_formats(cfg: SearchConfig) -> tuple[str, ...]:
    """The formats the winner can be in."""
    names = cfg.candidates or list(CANDIDATES)
    return tuple(dict.fromkeys(CANDIDATES[n][1] for n in names))


def _needs(cfg: SearchConfig) -> tuple[str, ...]:
    """A bf16 CPU when every listed candidate needs one (else those are only skipped)."""
    listed = cfg.candidates or []
    return ("bf16_cpu",) if listed and all(CANDIDATES[n][3] for n in listed) else ()


def _runtime(config: dict[str, Any], metrics: dict[str, Any]) -> str:
    winner = metrics.get("search_winner")
    return f"search winner: {CANDIDATES[winner][0]}" if winner in CANDIDATES else "search"


def _check_task(cfg: SearchConfig, task: str, index: int) -> list[str]:
    """The budget the family judges by: accuracy points for a classifier, fidelity and
    recall for an embedding model, Kendall's tau and nDCG@10 points for a reranker; an
    embedding model's and a reranker's shapes are distilled."""
    where = f"stages.{index}"
    if task == "reranking":
        problems = [] if any(getattr(cfg, o) is not None for o in RERANKER_BUDGETS) else [
            f"{where}: a reranker's search needs a budget: give min_kendall_tau (e.g. 0.9) "
            "or max_ndcg_drop (points, e.g. 1.0), or both"]
        problems += [f"{where}.{o}: a reranker is held to min_kendall_tau and max_ndcg_drop "
                     "against the float model; remove it" for o in BUDGETS
                     if o not in RERANKER_BUDGETS and getattr(cfg, o) is not None]
        return problems + _distilled_shapes(cfg, where, "a reranker", "score logits", "MSE")
    theirs = [f"{where}.{o}: a reranker's budget; {task} models are held to "
              + ("min_fidelity and min_recall_at_10" if task == "embedding" else
                 "max_accuracy_drop") + "; remove it"
              for o in RERANKER_BUDGETS if getattr(cfg, o) is not None]
    if task == "embedding":
        problems = [] if cfg.min_fidelity is not None or cfg.min_recall_at_10 is not None \
            else [f"{where}: an embedding model's search needs a budget: give min_fidelity "
                  "(e.g. 0.99) or min_recall_at_10 (e.g. 0.9), or both"]
        if cfg.max_accuracy_drop is not None:
            problems.append(f"{where}.max_accuracy_drop: an embedding model is held to "
                            "min_fidelity and min_recall_at_10 against the float model; "
                            "remove it")
        return theirs + problems + _distilled_shapes(
            cfg, where, "an embedding model", "embeddings", "|s - t|^2 + 1 - cos")
    problems = theirs + [f"{where}.{o}: an embedding model's budget; {task} models are held "
                         "to max_accuracy_drop; remove it"
                         for o in ("min_fidelity", "min_recall_at_10")
                         if getattr(cfg, o) is not None]
    if cfg.max_accuracy_drop is None:
        problems.append(f"{where}.max_accuracy_drop: required: the largest accuracy loss in "
                        "points against the model entering the search (e.g. 0.5)")
    return problems


def _distilled_shapes(cfg: SearchConfig, where: str, noun: str, outputs: str, loss: str
                      ) -> list[str]:
    """A family whose shapes learn the entering model's `outputs` by its own `loss` (no
    labels, no KD options)."""
    problems = [f"{where}.shapes.{k}.teacher: {noun}'s shapes are distilled from its "
                f"{outputs} (teacher: false fine-tunes on a classifier's labels); remove teacher"
                for k, s in enumerate(cfg.shapes or []) if not s.teacher]
    return problems + [f"{where}.shape_training.{o}: a classifier's distillation option; "
                       f"{noun}'s shapes learn its {outputs} ({loss}); remove it"
                       for o in ("temperature", "alpha", "layerwise")
                       if o in cfg.shape_training.model_fields_set]


SPEC = register(StageSpec(
    kind="search", config=SearchConfig, runner="compress.search.stage:run", order=65,
    makes_model=False, splits=_splits, runtime=_runtime,
    refused_before=("quantize", "precision"), check=_candidates_apply,
    reload="compress.stages.export:reload", export_formats=export_formats, needs=_needs,
    check_task=_check_task,
))

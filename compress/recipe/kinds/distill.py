"""Stage kind `distill`: its config and spec (no torch import; run module: distill.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from compress.recipe.options import StageName, StrictModel, TrainOptions
from compress.recipe.registry import StageSpec, register


class StudentSpec(StrictModel):
    """The student of a distillation: exactly one of layers, layer_indices, factory, hf_config."""

    layers: int | None = Field(
        None, ge=1, le=1000, description="Keep this many evenly spaced teacher layers.")
    layer_indices: list[int] | None = Field(
        None, min_length=1, description="Keep exactly these teacher layers (0-based).")
    factory: str | None = Field(
        None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="`module:factory` building the student.")
    kwargs: dict = Field(default_factory=dict, description="Arguments of the factory.")
    hf_config: dict | None = Field(
        None, description="Overrides of the teacher's HF config (a fresh student).")

    @model_validator(mode="after")
    def _exactly_one(self) -> StudentSpec:
        given = [k for k in ("layers", "layer_indices", "factory", "hf_config")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of layers, layer_indices, factory, hf_config "
                             f"(got {', '.join(given) or 'none'})")
        indices = self.layer_indices
        if indices is not None and (min(indices) < 0 or len(set(indices)) != len(indices)):
            raise ValueError("layer_indices must be distinct and non-negative")
        return self


class GridSpec(StrictModel):
    """The weight grid a causal LM's student trains on (quantization-aware distillation)."""

    scheme: Literal["int4_weight_only", "int8_weight_only"] = Field(
        description="The torchao weight scheme whose grid the student's Linears train on.")
    group_size: int = Field(32, description="int4: weights per scale group.")


class LayerwiseSpec(StrictModel):
    """Match intermediate representations as well as logits (TinyBERT, MiniLM)."""

    hidden_weight: float = Field(
        1.0, ge=0, le=1000, description="Weight of the hidden-state loss (after the "
        "embeddings and each student layer, against the teacher layer it maps to).")
    hidden_loss: Literal["mse", "cosine"] = Field(
        "mse", description="Distance of hidden states: mean squared error or cosine.")
    attention_weight: float = Field(
        0.0, ge=0, le=1000, description="Weight of KL(teacher || student) of the matched "
        "layers' attention distributions (trains with the eager attention kernel: slower).")


class DistillConfig(TrainOptions):
    """Knowledge distillation: the entering model is the frozen teacher of a smaller student."""

    kind: Literal["distill"] = "distill"
    name: StageName = None
    student: StudentSpec = Field(description="How the student is built.")
    temperature: float = Field(
        2.0, gt=0, le=1000, description="Softmax temperature T of the KL term.")
    alpha: float = Field(
        0.5, ge=0, le=1,
        description="Weight of cross-entropy; (1 - alpha) * T^2 weighs the KL term.")
    layerwise: LayerwiseSpec | None = Field(
        None, description="Classifiers from a Hugging Face teacher: also match hidden states "
        "(and attention) layer by layer; unset: logits only (KL + CE).")
    quantization_aware: GridSpec | None = Field(
        None, description="Causal LMs: train the student's decoder Linears fake-quantized on "
        "this scheme's grid (straight-through gradients) and snap them onto it, so a later "
        "`quantize` with the same scheme and group size keeps the distilled model (the output "
        "projection stays tied and float; `quantize` sets its scheme).")


def _after_structured_prune(recipe: Any, i: int) -> list[str]:
    """A structurally pruned teacher has layers of different widths: a layer-copying student
    cannot be built from it."""
    from compress.recipe.chain import model_chain

    pruned = [j for j in model_chain(recipe, i)
              if getattr(recipe.stages[j], "method", None) == "structured"]
    student = recipe.stages[i].student
    if pruned and (student.layers is not None or student.layer_indices is not None):
        return [f"stages.{i}: distill cannot copy layers of the structurally pruned model "
                f"of stages.{pruned[-1]}; distil before pruning, or build the student with "
                f"student.factory or student.hf_config"]
    return []


def _runtime(config: dict, metrics: dict) -> str:
    return "PyTorch eager (student)"


def _teacher_has_the_layers(recipe: Any, i: int, model_config: dict[str, Any]) -> list[str]:
    """A student that keeps more layers than its teacher has (known from config.json)."""
    from compress.recipe.chain import model_chain

    layers = model_config.get("num_hidden_layers")
    for j in model_chain(recipe, i):  # earlier distillations shrink the teacher
        student = getattr(recipe.stages[j], "student", None)
        if student is not None and layers is not None:
            layers = student.layers or (len(student.layer_indices or []) or None)
    spec = recipe.stages[i].student
    if layers is None:
        return []
    if spec.layers is not None and spec.layers > layers:
        return [f"stages.{i}.student.layers: {spec.layers} layers, but the teacher has {layers}"]
    if spec.layer_indices is not None and max(spec.layer_indices) >= layers:
        return [f"stages.{i}.student.layer_indices: the teacher has layers 0..{layers - 1}"]
    return []


def _check_task(cfg: DistillConfig, task: str, index: int) -> list[str]:
    """A causal LM's or an embedding model's student keeps some of its teacher's layers; a
    reranker's is a Hugging Face classifier (kept layers or hf_config) fitting its teacher's
    score logits."""
    where = f"stages.{index}"
    if task == "reranking":
        options = [o for o in ("temperature", "alpha", "layerwise", "quantization_aware")
                   if o in cfg.model_fields_set]
        options += ["student.factory"] if cfg.student.factory is not None else []
        return [f"{where}.{o}: not an option of a reranker's distillation, whose student "
                "(student.layers, student.layer_indices or student.hf_config) learns the "
                "teacher's score logits by MSE" for o in options]
    if task == "embedding":
        options = [o for o in ("temperature", "alpha", "layerwise", "quantization_aware")
                   if o in cfg.model_fields_set]
        options += [f"student.{o}" for o in ("factory", "hf_config")
                    if getattr(cfg.student, o) is not None]
        return [f"{where}.{o}: not an option of an embedding model's distillation, whose "
                "student keeps some of the teacher's layers (student.layers or "
                "student.layer_indices) and learns its embeddings by MSE and cosine"
                for o in options]
    if task != "causal-lm":
        problems = ([f"{where}.quantization_aware: only a causal LM takes this option; a "
                     "classifier's student is quantized by a later `quantize` stage (mode: qat)"]
                    if cfg.quantization_aware is not None else [])
        if cfg.layerwise is not None and cfg.student.factory is not None:
            problems.append(f"{where}.layerwise: matches the layers of Hugging Face encoders; "
                            "a student.factory model has none (drop layerwise)")
        return problems
    if cfg.layerwise is not None:
        return [f"{where}.layerwise: a classifier's option; a causal LM's student is "
                "distilled on next-token distributions"]
    grid = cfg.quantization_aware
    problems = []
    if grid is not None and grid.group_size not in (32, 64, 128, 256):
        problems.append(f"{where}.quantization_aware.group_size: {grid.group_size} is not one "
                        "of 32, 64, 128, 256 (torchao's int4 CPU packing)")
    if grid is not None and cfg.parallel == "fsdp":
        problems.append(f"{where}.quantization_aware: not with parallel: fsdp (the fake-quantized "
                        "weights are parametrizations FSDP does not shard); use ddp or one process")
    return problems + [f"{where}.student.{o}: a causal LM's student keeps teacher layers; "
                       "give student.layers or student.layer_indices"
                       for o in ("factory", "hf_config") if getattr(cfg.student, o) is not None]


SPEC = register(StageSpec(
    kind="distill", config=DistillConfig, runner="compress.stages.distill:run", order=20,
    data_parallel=True, splits=lambda cfg: ("train",), refused_before=("quantize",),
    check=_after_structured_prune, check_model=_teacher_has_the_layers, runtime=_runtime,
    check_task=_check_task,
))

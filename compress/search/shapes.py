"""The search's shapes: smaller students trained once each, in `shapes/<label>-<key>/`, with
the stages compress already has (distill, or plain fine-tuning of the kept layers, then
structured pruning with recovery), cached by key and resumed from their checkpoints after a
kill. Every candidate is then tried on each shape as on the entering model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from compress.algorithms.distill import build_student, encoder_layers
from compress.models.bundle import ModelBundle, count_params
from compress.models.folders import load_saved, save_model
from compress.recipe.kinds.distill import DistillConfig, StudentSpec
from compress.recipe.kinds.prune import PruneConfig
from compress.recipe.kinds.search import SearchConfig, ShapeSpec, ShapeTraining
from compress.recipe.options import TrainOptions
from compress.runfolder.files import atomic_write_json, read_json, sha256_json
from compress.stages.distill import distill
from compress.stages.prune import prune
from compress.train.loop import TrainSetup, total_steps

VERSION = 1
RECORD = "shape.json"
Setup = Callable[[Path, str], TrainSetup]  # (checkpoint folder, progress label) -> setup
# (teacher, spec, training, setup, folder, log) -> (student, figures): a family's shapes
ShapeTrainer = Callable[[ModelBundle, ShapeSpec, ShapeTraining, Setup, Path,
                         Callable[[str], None]], tuple[ModelBundle, dict[str, Any]]]


def shape_key(spec: ShapeSpec, training: ShapeTraining, input_sha: str, seed: int) -> str:
    """The cache key of one shape: what entered the stage, the shape and how it trains."""
    return sha256_json([VERSION, spec.model_dump(mode="json"),
                        training.model_dump(mode="json"), input_sha, seed])


def training_cost(spec: ShapeSpec, training: ShapeTraining, teacher_layers: int,
                  train_examples: int) -> int:
    """Layer passes per example over the shape's training, to order shapes cheapest first:
    distillation runs the teacher's layers and the student's, fine-tuning the student's,
    recovery the student's."""
    kept = spec.layers or teacher_layers
    cost = 0
    if spec.layers is not None:
        per_step = kept + (teacher_layers if spec.teacher else 0)
        cost += total_steps(train_examples, training) * training.batch_size * per_step
    if spec.ffn or spec.heads:
        cost += total_steps(train_examples, training.recovery) * \
            training.recovery.batch_size * kept
    return cost


def ordered_shapes(cfg: SearchConfig, bundle, train_examples: int) -> list[ShapeSpec]:
    """The shapes, cheapest to train first."""
    layers = len(encoder_layers(bundle.model))
    return sorted(cfg.shapes or [], key=lambda s: training_cost(
        s, cfg.shape_training, layers, train_examples))


def prune_steps(spec: ShapeSpec, recovery: TrainOptions) -> list[PruneConfig]:
    """The structured pruning configs of a shape; only the last recovers."""
    targets = [(t, a) for t, a in (("ffn", spec.ffn), ("heads", spec.heads)) if a]
    return [PruneConfig(method="structured", target=target, amount=amount,
                        recovery=recovery if i == len(targets) - 1 else None)
            for i, (target, amount) in enumerate(targets)]


def train_shape(teacher: ModelBundle, spec: ShapeSpec, training: ShapeTraining,
                setup: Setup, folder: Path, log: Callable[[str], None],
                loss_fn: Callable[..., Any] | None = None
                ) -> tuple[ModelBundle, dict[str, Any]]:
    """Build the shape from `teacher` (which it leaves alone) and train it, distilling and
    recovering by a family's `loss_fn` where given (default: the KD loss, and the labels
    after pruning); the student and its figures."""
    options = training.model_dump(exclude={"temperature", "alpha", "layerwise", "recovery"})
    figures: dict[str, Any] = {"teacher_layers": len(encoder_layers(teacher.model))}
    student = teacher
    if spec.layers is not None and spec.teacher:
        log(f"distilling {spec.layers} of {figures['teacher_layers']} layers")
        cfg = DistillConfig(student=StudentSpec(layers=spec.layers), **options,
                            temperature=training.temperature, alpha=training.alpha,
                            layerwise=training.layerwise)
        student, metrics = distill(teacher, cfg, setup(folder / "checkpoints" / "distill",
                                                       f"{spec.label} distill"), loss_fn)
        figures.update(distill_steps=metrics["train_steps"], distill_loss=metrics["train_loss"])
    elif spec.layers is not None:
        log(f"fine-tuning {spec.layers} of {figures['teacher_layers']} layers on the labels")
        student = build_student(teacher, StudentSpec(layers=spec.layers))
        result = setup(folder / "checkpoints" / "finetune", f"{spec.label} finetune").run(
            student.model, TrainOptions(**options), student.tokenizer)
        figures.update(finetune_steps=result.steps, finetune_loss=result.final_loss)
    else:
        student = build_student(teacher, StudentSpec(
            layers=figures["teacher_layers"]))  # a copy: pruning works in place
    return student, prune_shape(student, spec, training, setup, folder, log, figures,
                                loss_fn)


def prune_shape(student: ModelBundle, spec: ShapeSpec, training: ShapeTraining, setup: Setup,
                folder: Path, log: Callable[[str], None], figures: dict[str, Any],
                loss_fn: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Remove the shape's neurons and heads from `student` in place, recovering by
    `loss_fn` (default: the labels' cross-entropy); `figures` with the pruned layers and
    the student's final layers and parameters."""
    for cfg in prune_steps(spec, training.recovery):
        log(f"removing {100 * cfg.amount:.0f}% of the {cfg.target} with structured pruning"
            + (", then recovering" if cfg.recovery else ""))
        metrics = prune(student, cfg, setup(folder / "checkpoints" / f"prune_{cfg.target}",
                                            f"{spec.label} recovery"),
                        loss_fn=loss_fn if cfg.recovery else None)
        figures[f"pruned_{cfg.target}_layers"] = metrics["pruned_layers"]
    student.model.eval()
    return {**figures, "layers": len(encoder_layers(student.model)),
            "params": count_params(student.model)}


def load_or_train(teacher: ModelBundle, spec: ShapeSpec, training: ShapeTraining, key: str,
                  folder: Path, setup: Setup, log: Callable[[str], None],
                  trainer: ShapeTrainer = train_shape) -> tuple[ModelBundle, dict[str, Any]]:
    """The shape saved in `folder` under `key`, else trained now by `trainer` (resuming
    from its checkpoints) and saved; the student and the shape's record."""
    record_path = folder / RECORD
    record = read_json(record_path)
    if record.get("key") == key and (folder / "model").is_dir():
        return load_saved(folder / "model"), {**record, "cached": True}
    folder.mkdir(parents=True, exist_ok=True)
    student, figures = trainer(teacher, spec, training, setup, folder, log)
    save_model(student, folder / "model")
    record = {"key": key, "label": spec.label, "shape": spec.model_dump(mode="json"),
              **figures}
    atomic_write_json(record_path, record)
    return student, {**record, "cached": False}

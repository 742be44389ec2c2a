"""Recipe schema, loading, overrides and environment interpolation (no torch import).

A recipe is data: YAML becomes a frozen, validated `Recipe`. Every problem is reported
at once, each with its location and, for misspelt keys, a did-you-mean.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from pydantic import Field, ValidationError, model_serializer

from compress.errors import UserError
from compress.recipe_errors import format_validation_error
from compress.stages.configs import LEAF_KINDS, SERVABLE_FORMATS, STAGE_CONFIGS, StrictModel

StageConfig = Annotated[Union[tuple(STAGE_CONFIGS.values())], Field(discriminator="kind")]  # noqa: UP007


class ModelConfig(StrictModel):
    """Where the model comes from."""

    source: str = Field(
        description="Hugging Face id, local model folder, or `module:factory` import path."
    )
    num_labels: int | None = Field(
        None, ge=2, description="Classes of the classifier head (default: from the data)."
    )
    checkpoint: str | None = Field(
        None, description="Weights to load on top (.safetensors, or .pt/.pth with weights only)."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of a `module:factory` source."
    )


class SplitConfig(StrictModel):
    """One split of the data: its name (or file) and how many examples to take."""

    split: str = Field(description="Split name (`train`, `validation`, ...) or a file path.")
    max_samples: int | None = Field(
        None, ge=1, description="Take at most this many examples (a seeded random subset)."
    )


class DataConfig(StrictModel):
    """The dataset and its splits."""

    source: str = Field(
        description="Hugging Face dataset id, a local folder or file (TSV/CSV/JSONL), "
        "or `sklearn:digits`."
    )
    text_column: str = Field("text", description="Column holding the text (text datasets).")
    label_column: str = Field("label", description="Column holding the label.")
    label_names: list[str] | None = Field(
        None, description="Names of the label ids 0..N-1 (default: from the data)."
    )
    max_length: int = Field(128, ge=8, le=4096, description="Truncate texts to this many tokens.")
    holdout_fraction: float = Field(
        0.2, gt=0, lt=1, description="Held-out share for datasets without splits (digits)."
    )
    train: SplitConfig = Field(default_factory=lambda: SplitConfig(split="train"))
    calibration: SplitConfig = Field(
        default_factory=lambda: SplitConfig(split="train", max_samples=256)
    )
    eval: SplitConfig = Field(default_factory=lambda: SplitConfig(split="validation"))


class LatencyConfig(StrictModel):
    """How latency is measured (one harness for every artifact)."""

    enabled: bool = Field(True, description="Measure latency after every stage.")
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=lambda: [1, 8], min_length=1, description="Batch sizes to time."
    )
    seq_len: int = Field(128, ge=1, description="Sequence length of text inputs.")
    warmup: int = Field(3, ge=0, description="Untimed iterations before timing.")
    iters: int = Field(15, ge=1, description="Timed iterations; the median is reported.")
    threads: int | None = Field(None, ge=1, description="torch threads (default: all cores).")
    seq_lens: list[Annotated[int, Field(ge=1)]] | None = Field(
        None, description="Extra text sequence lengths to time besides seq_len."
    )

    @model_serializer(mode="wrap")
    def _drop_unset_seq_lens(self, handler) -> dict[str, Any]:
        """Leave `seq_lens` out while unset, so recipes without it keep their cache keys."""
        data = handler(self)
        if isinstance(data, dict) and data.get("seq_lens") is None:
            data.pop("seq_lens", None)
        return data


class EvaluationConfig(StrictModel):
    """Evaluation after every stage."""

    batch_size: int = Field(64, ge=1, description="Batch size of the accuracy pass.")
    baseline: bool = Field(True, description="Measure the model before any stage.")
    latency: LatencyConfig = Field(default_factory=LatencyConfig)


class Recipe(StrictModel):
    """A whole compression recipe."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Run name.")
    model: ModelConfig
    data: DataConfig
    stages: list[StageConfig] = Field(default_factory=list)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    output_dir: str = Field("runs", description="Parent folder of the run folder.")
    seed: int = Field(0, description="Seed of data sampling and training.")


def stage_names(recipe: Recipe) -> list[str]:
    """Display names of the stages, in order: the `name` option or the kind."""
    return [s.name or s.kind for s in recipe.stages]


# --------------------------------------------------------------------------- loading


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, override, interpolate and validate a recipe; raise UserError with every problem."""
    raw = read_yaml(path)
    raw = apply_overrides(raw, overrides)
    problems: list[str] = []
    raw = interpolate_env(raw, problems)
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as exc:
        env_keys = {p.split(":")[0] for p in problems}
        problems += [p for p in format_validation_error(exc, Recipe)
                     if p.split(":")[0] not in env_keys]
        raise UserError(problems) from None
    if problems:
        raise UserError(problems)
    problems = check_stage_order(recipe)
    if problems:
        raise UserError(problems)
    return recipe


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a recipe file into a mapping, with a clear error for a missing or malformed file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: recipe file not found (check the path)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"{path}{where}: malformed YAML: {problem}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a recipe must be a YAML mapping with name, model, data, stages")
    return data


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def interpolate_env(node: Any, problems: list[str], where: str = "") -> Any:
    """Replace `${VAR}` and `${VAR:-default}` in every string value."""
    if isinstance(node, dict):
        return {k: interpolate_env(v, problems, f"{where}.{k}" if where else str(k))
                for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate_env(v, problems, f"{where}[{i}]") for i, v in enumerate(node)]
    if not isinstance(node, str):
        return node

    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        value = os.environ.get(name)
        if value is not None:
            return value
        if default is not None:
            return default
        problems.append(
            f"{where}: environment variable {name} is not set "
            f"(set it, or write ${{{name}:-default}})"
        )
        return match.group(0)

    return _ENV.sub(substitute, node)


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply `a.b.0.c=value` overrides (values parsed as YAML scalars) to a recipe mapping."""
    problems = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            problems.append(f"override '{item}': expected KEY=VALUE, e.g. stages.0.max_steps=50")
            continue
        try:
            value = yaml.safe_load(text) if text else ""
        except yaml.YAMLError:
            value = text
        error = _set_path(raw, key.split("."), value)
        if error:
            problems.append(f"override '{item}': {error}")
    if problems:
        raise UserError(problems)
    return raw


def _set_path(node: Any, parts: list[str], value: Any) -> str | None:
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit():
                return f"'{here}': a list needs a numeric index"
            index = int(part)
            if index >= len(node):
                return f"'{here}': index {index} out of range (the list has {len(node)} items)"
            if last:
                node[index] = value
            else:
                node = node[index]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            return f"'{'.'.join(parts[:i])}' is a value, not a section"
    return None


def check_stage_order(recipe: Recipe) -> list[str]:
    """Rules between stages: each kind's `needs_before` comes earlier, names are unique, an
    export's `source` names an earlier model, and its format can hold that model."""
    problems = []
    seen: set[str] = set()
    names: set[str] = set()
    for i, stage in enumerate(recipe.stages):
        for needed in getattr(stage, "needs_before", ()):
            if needed not in seen:
                problems.append(
                    f"stages[{i}] ({stage.kind}): needs a '{needed}' stage before it"
                )
        label = stage.name or stage.kind
        if stage.name and label in names:
            problems.append(f"stages[{i}] ({stage.kind}).name: '{label}' is used twice")
        names.add(label)
        seen.add(stage.kind)
        if stage.kind == "export":
            problems += _export_problems(recipe, i)
        if stage.kind == "package":
            problems += _package_problems(recipe, i)
    return problems


def model_stage_index(recipe: Recipe, i: int) -> int | None:
    """Index of the stage whose model enters stage i (None: the recipe's model).

    Export stages are leaves: they never hand on a model. An export's `source` picks an
    earlier stage by index, name or kind (the latest one of that kind).
    """
    source = getattr(recipe.stages[i], "source", None)
    if source is not None:
        return _find_source(recipe, i, source)
    for j in range(i - 1, -1, -1):
        if recipe.stages[j].kind not in LEAF_KINDS:
            return j
    return None


def _find_source(recipe: Recipe, i: int, source: str | int) -> int:
    text = str(source)
    earlier = [j for j in range(i) if recipe.stages[j].kind not in LEAF_KINDS]
    if text.isdigit() and int(text) in earlier:
        return int(text)
    for j in reversed(earlier):
        if text in (recipe.stages[j].name, recipe.stages[j].kind):
            return j
    choices = ", ".join(f"{j} ({recipe.stages[j].name or recipe.stages[j].kind})"
                        for j in earlier) or "none"
    raise ValueError(f"source: '{source}' is not an earlier stage that makes a model "
                     f"(choices: {choices})")


def _export_problems(recipe: Recipe, i: int) -> list[str]:
    stage = recipe.stages[i]
    where = f"stages[{i}] (export)"
    try:
        j = model_stage_index(recipe, i)
    except ValueError as exc:
        return [f"{where}.{exc}"]
    chain = recipe.stages[: j + 1] if j is not None else []
    quantized = any(s.kind == "quantize" for s in chain)
    if quantized and stage.format in ("torchscript", "onnx"):
        return [f"{where}.format: {stage.format} cannot hold the PT2E int8 model it would "
                f"export; use format aoti for it, or set source to a stage before the "
                f"quantize stage to export the float model"]
    if quantized and stage.format == "tensorrt":
        return [f"{where}.format: tensorrt takes a float model; set source to a stage before "
                f"the quantize stage"]
    if stage.format == "tensorrt" and not cuda_device_present():
        return [f"{where}: TensorRT export needs a CUDA GPU (none found)"]
    return []


def export_stage_index(recipe: Recipe, i: int) -> int:
    """Index of the export stage that package stage i archives (its `artifact`, by name or
    index; default: the latest export before it). Raises ValueError when there is none."""
    exports = [j for j in range(i) if recipe.stages[j].kind == "export"]
    artifact = recipe.stages[i].artifact
    if artifact is None and exports:
        return exports[-1]
    text = str(artifact)
    if text.isdigit() and int(text) in exports:
        return int(text)
    for j in reversed(exports):
        if text == (recipe.stages[j].name or "export"):
            return j
    if not exports:
        raise ValueError("artifact: no export stage comes before this package stage; add "
                         "one, e.g. {kind: export, format: onnx}")
    choices = ", ".join(f"{j} ({recipe.stages[j].name or 'export'})" for j in exports)
    raise ValueError(f"artifact: '{artifact}' is not an earlier export stage (choices: "
                     f"{choices})")


def _package_problems(recipe: Recipe, i: int) -> list[str]:
    where = f"stages[{i}] (package)"
    try:
        j = export_stage_index(recipe, i)
    except ValueError as exc:
        return [f"{where}.{exc}"]
    fmt = recipe.stages[j].format
    if fmt not in SERVABLE_FORMATS:
        return [f"{where}.artifact: a {fmt} export cannot be served on the CPU workers this "
                f"handler runs; package an export of format {', '.join(SERVABLE_FORMATS)}"]
    return []


def cuda_device_present() -> bool:
    """Whether an NVIDIA GPU is visible, without importing torch (driver device files)."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or Path("/dev/nvidia0").exists()

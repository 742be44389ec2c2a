"""Recipe schema and validation (no torch import).

A recipe is data: YAML becomes a frozen, validated `Recipe`. Validation runs every phase
(overrides, environment, schema, rules between stages, model and data sources) and reports
every problem at once, one line each, located in override syntax (`stages.0.batch_size`)
so a location can be pasted back as `KEY=VALUE`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import Field, ValidationError, model_serializer

from compress.errors import UserError
from compress.recipe.chain import check_stage_order
from compress.recipe.files import apply_overrides, interpolate_env, read_yaml
from compress.recipe.messages import format_validation_error
from compress.recipe.options import StrictModel
from compress.recipe.registry import stage_configs
from serve.handler_settings import HandlerSettings

StageConfig = Annotated[Union[tuple(stage_configs().values())],  # noqa: UP007
                        Field(discriminator="kind")]


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
    task: Literal["classification", "causal-lm", "embedding", "reranking"] | None = Field(
        None, description="Model family (default: `causal-lm` for a GGUF file or a "
        "`*ForCausalLM` config, `reranking` for a sentence-transformers CrossEncoder folder, "
        "else `classification`; `embedding`: a sentence-transformers model, scored by how "
        "close its embeddings stay to the float model's; `reranking`: a cross-encoder, "
        "scored by nDCG@10 and MRR@10 on query-document pairs and by Kendall's tau against "
        "the float model's scores)."
    )


class SplitConfig(StrictModel):
    """One split of the data: its name (or file) and how many examples to take."""

    split: str = Field(description="Split name (`train`, `validation`, ...) or a file path.")
    max_samples: int | None = Field(
        None, ge=1, le=10**9,
        description="Take at most this many examples (a seeded random subset)."
    )


class DataConfig(StrictModel):
    """The dataset and its splits."""

    source: str = Field(
        description="Hugging Face dataset id, a local folder or file (TSV/CSV/JSONL), "
        "or `sklearn:digits`."
    )
    text_column: str = Field("text", description="Column holding the text (text datasets).")
    label_column: str = Field("label", description="Column holding the label.")
    pair_column: str | None = Field(
        None, description="Rerankers: the column holding each pair's document (the query "
        "in text_column, its relevance in label_column; rows with the same query are its "
        "documents). Unset: known-item pairs built from text_column's sentences (a few "
        "words of a sentence as the query; the sentence and those sharing the most words "
        "with it as documents).")
    label_names: list[str] | None = Field(
        None, description="Names of the label ids 0..N-1 (default: from the data)."
    )
    max_length: int = Field(128, ge=8, le=4096, description="Truncate texts to this many tokens.")
    prompts: str | None = Field(
        None, description="Causal LM: generation prompts, one per line (.txt) or JSONL with "
        "`prompt` or `messages` (default: the start of the first eval texts).")
    chat_template: bool = Field(
        True, description="Causal LM: wrap each prompt in the tokenizer's chat template, "
        "when it has one.")
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
    batch_sizes: list[Annotated[int, Field(ge=1, le=65_536)]] = Field(
        default_factory=lambda: [1, 8], min_length=1, description="Batch sizes to time."
    )
    seq_len: int = Field(128, ge=1, le=1_000_000, description="Sequence length of text inputs.")
    warmup: int = Field(3, ge=0, le=100_000, description="Untimed iterations before timing.")
    iters: int = Field(
        15, ge=1, le=1_000_000, description="Timed iterations; the median is reported.")
    threads: int | None = Field(
        None, ge=1, le=4096, description="torch threads (default: all cores).")
    seq_lens: list[Annotated[int, Field(ge=1, le=1_000_000)]] | None = Field(
        None, description="Extra text sequence lengths to time besides seq_len."
    )
    real_lengths: bool = Field(
        True, description="Also time text models on the eval split's own sentences, in "
        "batches of each batch size padded per batch (latency_ms_bN_real).")
    real_limit: int | None = Field(
        None, ge=1, le=10_000_000, description="Time real lengths on the eval split's first "
        "N sentences only (default: all of them).")

    @model_serializer(mode="wrap")
    def _drop_unset_seq_lens(self, handler) -> dict[str, Any]:
        """Leave `seq_lens` out while unset, so recipes without it keep their cache keys."""
        data = handler(self)
        if isinstance(data, dict) and data.get("seq_lens") is None:
            data.pop("seq_lens", None)
        if isinstance(data, dict) and data.get("real_lengths") is True:
            data.pop("real_lengths", None)  # the default: earlier cache keys stay valid
        if isinstance(data, dict) and data.get("real_limit") is None:
            data.pop("real_limit", None)
        return data


class GenerationConfig(StrictModel):
    """How a causal LM's generation is measured after every stage."""

    prompts: int = Field(20, ge=1, le=10_000, description="Prompts to generate from.")
    max_new_tokens: int = Field(32, ge=2, le=4096, description="Greedy tokens per prompt.")
    batch_sizes: list[Annotated[int, Field(ge=1, le=256)]] = Field(
        default_factory=lambda: [1, 4], min_length=1,
        description="Decode batch sizes to time (static KV cache).")
    compile: Literal["none", "default", "max-autotune"] = Field(
        "max-autotune", description="torch.compile mode of the decode step (Inductor "
        "freezing on), or none for eager.")
    eager_generate: bool = Field(
        True, description="Also time Hugging Face `generate` at batch 1 (eager, dynamic "
        "cache): the naive path the other figures are compared with.")
    cache_len: int = Field(HandlerSettings.cache_len, ge=16, le=131_072,
                           description="Static KV cache positions.")


class LmEvalConfig(StrictModel):
    """lm-evaluation-harness tasks scored for a causal LM before any stage and after each."""

    tasks: list[Annotated[str, Field(min_length=1)]] = Field(
        min_length=1, description="lm-eval task names: the local ones in recipes/tasks "
        "(sst2_local, sst2_rolling), or any installed task whose data can be reached.")
    limit: int | None = Field(None, ge=1, le=1_000_000,
                              description="Documents per task (none: every one).")
    include_path: str | None = Field(
        None, description="A folder of task YAML files beside lm-eval's own (default: "
        "compress's recipes/tasks).")
    max_length: int = Field(2048, ge=16, le=131_072,
                            description="Tokens one forward scores at most.")


class MtebConfig(StrictModel):
    """MTEB tasks scored for an embedding model before any stage and after each."""

    tasks: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda: ["SST2LocalClassification", "SST2KnownItemRetrieval"],
        min_length=1, description="MTEB task names: the local ones (SST2LocalClassification, "
        "SST2KnownItemRetrieval, over the SST-2 mirror), or any of MTEB's own whose data "
        "can be reached.")
    limit: int | None = Field(None, ge=1, le=1_000_000, description="Local tasks: the first "
                              "N validation sentences (none: all 872).")


class EvaluationConfig(StrictModel):
    """Evaluation after every stage."""

    batch_size: int = Field(64, ge=1, le=65_536, description="Batch size of the accuracy pass.")
    baseline: bool = Field(True, description="Measure the model before any stage.")
    latency: LatencyConfig = Field(default_factory=LatencyConfig)
    generation: GenerationConfig = Field(
        default_factory=GenerationConfig, description="Causal LMs: generation figures.")
    lm_eval: LmEvalConfig | None = Field(
        None, description="Causal LMs: lm-evaluation-harness tasks scored for every stage.")
    mteb: MtebConfig | None = Field(
        None, description="Embedding models: MTEB tasks scored for every stage.")

    @model_serializer(mode="wrap")
    def _drop_default_generation(self, handler) -> dict[str, Any]:
        """Leave `generation`, `lm_eval` and `mteb` out while unset, so recipes without them
        keep their cache keys."""
        data = handler(self)
        if isinstance(data, dict) and "generation" not in self.model_fields_set:
            data.pop("generation", None)
        for optional in ("lm_eval", "mteb"):
            if isinstance(data, dict) and data.get(optional) is None:
                data.pop(optional, None)
        return data


class Recipe(StrictModel):
    """A whole compression recipe."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Run name.")
    model: ModelConfig
    data: DataConfig
    stages: list[StageConfig] = Field(default_factory=list)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    output_dir: str = Field("runs", description="Parent folder of the run folder.")
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of data sampling and training.")


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = (),
                check_sources: bool = False,
                edit: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Recipe:
    """Read, override, interpolate and validate a recipe; raise one UserError with every
    problem found. `check_sources` also resolves the model and data and checks every split
    and column the recipe uses (what `compress validate` and `compress run` do); `edit`
    changes the file's content before the overrides (`compress search` adds a stage)."""
    raw = read_yaml(path)
    if edit is not None:
        raw = edit(raw)
    problems: list[str] = []
    try:
        raw = apply_overrides(raw, overrides)
    except UserError as exc:
        problems += exc.messages
    raw = interpolate_env(raw, problems)
    env_keys = {p.split(":")[0] for p in problems}
    recipe, schema_problems = validate_raw(raw)
    problems += [p for p in schema_problems if p.split(":")[0] not in env_keys]
    if recipe is not None:
        problems += [p for p in check_stage_order(recipe) if p not in problems]
        if check_sources:
            from compress.recipe.sources import source_problems

            refused = {p.split(": ", 1)[0] for p in schema_problems}  # a key the schema
            # refused (and dropped) is not reported again as missing
            problems += [p for p in source_problems(recipe)
                         if p not in problems and p.split(": ", 1)[0] not in refused]
    if problems:
        raise UserError(problems)
    return recipe


def validate_raw(raw: dict[str, Any]) -> tuple[Recipe | None, list[str]]:
    """(the recipe, its schema problems). With problems, the recipe is the one left after
    dropping each offending key (so later phases still check the rest), or None when
    dropping keys cannot make it valid (a missing required key, an unknown stage kind)."""
    try:
        return Recipe.model_validate(raw), []
    except ValidationError as exc:
        problems = format_validation_error(exc, Recipe)
        errors = exc.errors()
    repaired = copy.deepcopy(raw)
    for _ in range(5):
        if not all(_drop(repaired, err["loc"]) for err in errors):
            return None, problems
        try:
            return Recipe.model_validate(repaired), problems
        except ValidationError as again:
            errors = again.errors()
    return None, problems


def _drop(raw: Any, loc: tuple[Any, ...]) -> bool:
    """Delete the key at `loc` (pydantic's location; stage kinds are skipped); False when
    it is not a key that has a default to fall back on."""
    node, parts = raw, [p for p in loc if not (isinstance(p, str) and p in stage_configs())]
    for part in parts[:-1]:
        in_dict = isinstance(node, dict) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and part < len(node)
        if in_dict or in_list:
            node = node[part]
        else:
            return False
    if not parts or not isinstance(node, dict) or parts[-1] not in node or parts[-1] == "kind":
        return False
    del node[parts[-1]]
    return True

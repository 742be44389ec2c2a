"""Stage kind `package`: its config and spec (no torch import; run module: package.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from compress.recipe.options import StageName, StrictModel
from compress.recipe.parallel import (
    PARALLEL,
    ExpertParallel,
    Oversubscribe,
    PipelineParallel,
    TensorParallel,
    parallel_fits_the_config,
    parallel_problems,
)
from compress.recipe.registry import StageSpec, register, spec_of
from serve.handler_settings import HandlerSettings

SERVABLE_FORMATS = ("torchscript", "onnx", "aoti", "transformers")
# the options only a causal LM's archive takes (its generation handler's)
CAUSAL_LM_ONLY_OPTIONS = ("max_new_tokens", "cache_len", "decode_compile", "decode_cpp_wrapper",
                          "precompile", "prefill_chunk", "prefill_compile", "prefix_cache",
                          "prefix_cache_mb", "speculate",
                          *PARALLEL)


class PackageConfig(StrictModel):
    """A TorchServe archive (.mar) of an exported file with compress's batching handler
    (causal LMs: the streaming generation handler; embedding models: the embedding handler,
    which also answers OpenAI's v1/embeddings; rerankers: the reranker handler, which also
    answers v1/rerank).

    A leaf like export: it adds `<model_name>.mar` and hands nothing on."""

    kind: Literal["package"] = "package"
    name: StageName = None
    artifact: str | int | None = Field(
        None, description="The export (or search) stage to package (name or index; default: "
        "the latest one before this stage).")
    model_name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Name served at /predictions/<name> (default: the recipe's name).")
    version: str = Field("1.0", pattern=r"^[0-9][0-9A-Za-z.]*$", description="Model version.")
    batch_size: int = Field(
        8, ge=1, le=1024, description="Largest batch TorchServe forms from waiting requests.")
    max_batch_delay_ms: int = Field(
        20, ge=0, le=10_000, description="How long TorchServe waits to fill a batch.")
    workers: int = Field(1, ge=1, le=64, description="Worker processes (min = max workers).")
    threads: int | None = Field(
        None, ge=1, le=4096, description="Intra-op threads per worker (default: cores / "
        "workers; workers x threads is capped at the cores).")
    response_timeout_s: int = Field(
        120, ge=1, le=86_400, description="Seconds before TorchServe gives up on a batch.")
    startup_timeout_s: int = Field(
        600, ge=1, le=86_400, description="Seconds TorchServe lets a worker load the model "
        "(a causal LM compiles its decode step per batch bucket as it starts: several "
        "minutes for SmolLM2 on 2 cores, where TorchServe's default 120 s kills it).")
    max_text_chars: int = Field(
        HandlerSettings.max_text_chars, ge=1, le=10**8,
        description="Longer texts are refused with a 400 (tokens past the recipe's "
        "max_length are truncated).")
    length_buckets: bool = Field(
        HandlerSettings.length_buckets,
        description="Text classifiers and embedding models: run a batch's texts in "
        "forward passes of similar length (sorted, cut where a pass's fixed cost is worth the "
        "padding it saves), so that a short text is not padded to the batch's longest.")
    max_new_tokens: int | None = Field(
        None, ge=1, le=32_768, description="Causal LMs: the most new tokens a request may ask "
        f"for (more: a 400; default: {HandlerSettings.max_new_tokens}, at most half the "
        "cache).")
    cache_len: int | None = Field(
        None, ge=16, le=131_072, description="Causal LMs: KV cache positions per row, prompt "
        "and new tokens together (a longer request: a 400; default: "
        "evaluation.generation.cache_len).")
    tensor_parallel: TensorParallel = None
    pipeline_parallel: PipelineParallel = None
    expert_parallel: ExpertParallel = None
    oversubscribe: Oversubscribe = False
    decode_compile: Literal["none", "default", "max-autotune"] | None = Field(
        None, description="Causal LMs: torch.compile mode of the served decode step, each "
        "batch-size bucket compiled once (default: the model's, set by a compile stage, else "
        "none).")
    decode_cpp_wrapper: bool = Field(
        HandlerSettings.cpp_wrapper,
        description="Causal LMs, decode_compile: Inductor writes the step's wrapper in "
        "C++ (less Python between tokens, as benchmarks.causal_lm.peers measures it).")
    precompile: bool = Field(
        True, description="Causal LMs, decode_compile, continuous batching: compile the "
        "served graphs here and ship them in the archive, so that a worker on the same CPU "
        "and torch starts in seconds (on another it compiles afresh).")
    prefill_chunk: int = Field(
        HandlerSettings.prefill_chunk, ge=1,
        description="Causal LMs, continuous batching: the most prompt positions "
        "prefilled between two decode steps of the running rows, fewer where they would take "
        "longer than a decode step (a long prompt does not freeze them).")
    prefill_compile: bool = Field(
        HandlerSettings.prefill_compile,
        description="Causal LMs, decode_compile with precompile, continuous batching: the "
        "prefill compiled ahead of time too, an AOTInductor package beside the decode steps "
        "(nothing to compile at start; a one-prompt prefill in 0.82x the eager time on a "
        "2-core Zen 1). false, "
        "or an archive without it: workers prefill eagerly.")
    prefix_cache: bool | int = Field(
        HandlerSettings.prefix_cache,
        description="Causal LMs, continuous batching: reuse the keys and values of "
        "prompt prefixes seen before (true: up to 4 x cache_len positions; a number: that "
        "many; false: off).")
    prefix_cache_mb: float | None = Field(
        HandlerSettings.prefix_cache_mb, gt=0,
        description="Causal LMs, continuous batching: the prefix cache's bound in MB of keys "
        "and values (wins over prefix_cache's positions; SmolLM2-135M's float32 cache takes "
        "45 KB a position: 4 x 512 positions are 90 MB).")
    speculate: int = Field(
        HandlerSettings.speculate, ge=0, le=16,
        description="Causal LMs, continuous batching: the most prompt-lookup drafts a row "
        "verifies in one step (0: off). Every row's answer stays its plain one; each step "
        "speculates only where the measured step times and the rows' acceptance say it "
        "pays (benchmarks.causal_lm.micro.batched_speculation measures it). With precompile, "
        "2 or more ships the verification as an AOTInductor package too.")


def export_stage_index(recipe: Any, i: int) -> int:
    """Index of the stage whose export folder package stage i archives (its `artifact`, by
    name or index; default: the latest stage before it that writes one: an export, a
    search). Raises ValueError when there is none."""
    exports = [j for j in range(i) if spec_of(recipe.stages[j].kind).export_formats]
    artifact = recipe.stages[i].artifact
    if artifact is None and exports:
        return exports[-1]
    text = str(artifact)
    if text.isdigit() and int(text) in exports:
        return int(text)
    for j in reversed(exports):
        if text == (recipe.stages[j].name or recipe.stages[j].kind):
            return j
    if not exports:
        raise ValueError("artifact: no export stage comes before this package stage; add "
                         "one, e.g. {kind: export, format: onnx}")
    choices = ", ".join(f"{j} ({recipe.stages[j].name or recipe.stages[j].kind})"
                        for j in exports)
    raise ValueError(f"artifact: '{artifact}' is not an earlier export stage (choices: "
                     f"{choices})")


def _servable(recipe: Any, i: int) -> list[str]:
    try:
        j = export_stage_index(recipe, i)
    except ValueError as exc:
        return [f"stages.{i}.{exc}"]
    stage = recipe.stages[j]
    unservable = [f for f in spec_of(stage.kind).export_formats(stage)
                  if f not in SERVABLE_FORMATS]
    if unservable:
        return [f"stages.{i}.artifact: a {unservable[0]} export cannot be served on the CPU "
                f"workers this handler runs; package an export of format "
                f"{', '.join(SERVABLE_FORMATS)}"]
    return []


def causal_lm_max_new_tokens(cfg: PackageConfig, cache_len: int) -> int:
    """The most new tokens a causal LM's request may ask for."""
    return cfg.max_new_tokens or min(HandlerSettings.max_new_tokens, cache_len // 2)


def _fits_the_cache(recipe: Any, i: int) -> list[str]:
    """A causal LM's largest request must leave room for a prompt in the cache."""
    stage = recipe.stages[i]
    cache = stage.cache_len or recipe.evaluation.generation.cache_len
    if stage.max_new_tokens is not None and stage.max_new_tokens >= cache:
        return [f"stages.{i}.max_new_tokens: {stage.max_new_tokens} leaves no room for a "
                f"prompt in a cache of {cache} positions; lower it or raise cache_len"]
    return []


def _check_task(cfg: PackageConfig, task: str, index: int) -> list[str]:
    """Handler options of the other family."""
    where = f"stages.{index}"
    if task == "causal-lm":
        if "max_text_chars" in cfg.model_fields_set:
            return [f"{where}.max_text_chars: a classifier's option; a causal LM's requests "
                    "are bounded by max_new_tokens and cache_len"]
        if "length_buckets" in cfg.model_fields_set:
            return [f"{where}.length_buckets: a text encoder's option; a causal LM batches "
                    "its rows continuously"]
        return []
    return [f"{where}.{o}: only a causal LM takes this option" for o in CAUSAL_LM_ONLY_OPTIONS
            if o in cfg.model_fields_set]


def _runtime(config: dict[str, Any], metrics: dict[str, Any]) -> str:
    from compress.recipe.kinds.export import RUNTIMES

    served = metrics.get("served_format")
    return "TorchServe .mar" + (f" ({RUNTIMES.get(served, served)})" if served else "")


SPEC = register(StageSpec(
    kind="package", config=PackageConfig, runner="compress.stages.package:run", order=70,
    makes_model=False, takes_model=False, measured=False,
    code_modules=("compress.serving.archive",),
    runtime=_runtime,
    input_stage=export_stage_index,
    check=lambda recipe, i: (_servable(recipe, i) + _fits_the_cache(recipe, i)
                             + parallel_problems(recipe, i)),
    check_model=parallel_fits_the_config,
    check_task=_check_task,
    # an archive ships serve/'s own modules (compress.serving.archive) and its family's package
    shipped_code={"classification": ("serve.classifier",), "embedding": ("serve.embedding",),
                  "reranking": ("serve.reranker",), "causal-lm": ("serve.causal_lm",)},
))

"""Stage kind `package`: its config and spec (no torch import; run module: package.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

import serve.causal_lm as causal_lm_code
import serve.embedding as embedding_code
from compress.recipe.expert_parallel_checks import expert_problems, experts_fit_the_config
from compress.recipe.options import StageName, StrictModel
from compress.recipe.pipeline_parallel_checks import pipeline_problems, stages_fit_the_config
from compress.recipe.registry import StageSpec, register, spec_of
from compress.recipe.tensor_parallel_checks import split_fits_the_config, split_problems

SERVABLE_FORMATS = ("torchscript", "onnx", "aoti", "transformers")
LM_OPTIONS = ("max_new_tokens", "cache_len", "decode_compile", "decode_cpp_wrapper",
              "precompile", "prefill_chunk", "prefill_compile", "prefix_cache",
              "tensor_parallel", "pipeline_parallel", "expert_parallel", "oversubscribe")


class PackageConfig(StrictModel):
    """A TorchServe archive (.mar) of an exported file with compress's batching handler
    (causal LMs: the streaming generation handler; embedding models: the embedding handler,
    which also answers OpenAI's v1/embeddings).

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
        10_000, ge=1, le=10**8, description="Longer texts are refused with a 400 (tokens past "
        "the recipe's max_length are truncated).")
    length_buckets: bool = Field(
        True, description="Text classifiers and embedding models: run a batch's texts in "
        "forward passes of similar length (sorted, cut where a pass's fixed cost is worth the "
        "padding it saves), so that a short text is not padded to the batch's longest.")
    max_new_tokens: int | None = Field(
        None, ge=1, le=32_768, description="Causal LMs: the most new tokens a request may ask "
        "for (more: a 400; default: 256, at most half the cache).")
    cache_len: int | None = Field(
        None, ge=16, le=131_072, description="Causal LMs: KV cache positions per row, prompt "
        "and new tokens together (a longer request: a 400; default: "
        "evaluation.generation.cache_len).")
    tensor_parallel: int | None = Field(
        None, ge=2, le=64, description="Causal LMs: serve each worker as a torchrun job of N "
        "ranks (TorchServe's parallelType: tp); the handler splits the decoder layers across "
        "them with torch's tensor parallelism. Takes a float model; no compiled decode.")
    pipeline_parallel: int | None = Field(
        None, ge=2, le=64, description="Causal LMs: serve each worker as a torchrun job of N "
        "ranks (TorchServe's parallelType: pp); the handler cuts the decoder layers into N "
        "pipeline stages (torch.distributed.pipelining) and recomputes each token through "
        "them (no KV cache). Takes a float32 model; no compiled decode.")
    expert_parallel: int | None = Field(
        None, ge=2, le=64, description="Mixture-of-experts causal LMs: serve each worker as a "
        "torchrun job of N ranks, each holding 1/N of every layer's experts (tokens sent to "
        "them with all_to_all_single); rank 0 gets the requests and leads. No compiled "
        "decode.")
    oversubscribe: bool = Field(
        False, description="tensor_parallel, pipeline_parallel, expert_parallel: allow more "
        "ranks than this machine has cores (they share them and run slower).")
    decode_compile: Literal["none", "default", "max-autotune"] | None = Field(
        None, description="Causal LMs: torch.compile mode of the served decode step, each "
        "batch-size bucket compiled once (default: the model's, set by a compile stage, else "
        "none).")
    decode_cpp_wrapper: bool = Field(
        True, description="Causal LMs, decode_compile: Inductor writes the step's wrapper in "
        "C++ (less Python between tokens, as benchmarks/peers_llm.py measures it).")
    precompile: bool = Field(
        True, description="Causal LMs, decode_compile, continuous batching: compile the "
        "served graphs here and ship them in the archive, so that a worker on the same CPU "
        "and torch starts in seconds (on another it compiles afresh).")
    prefill_chunk: int = Field(
        32, ge=1, description="Causal LMs, continuous batching: the most prompt positions "
        "prefilled between two decode steps of the running rows, fewer where they would take "
        "longer than a decode step (a long prompt does not freeze them).")
    prefill_compile: bool = Field(
        False, description="Causal LMs, decode_compile, continuous batching: prefill through "
        "compiled graphs too (two more graphs a worker traces as it starts, about 5-8 s "
        "each on 2 cores, even with precompile).")
    prefix_cache: bool | int = Field(
        True, description="Causal LMs, continuous batching: reuse the keys and values of "
        "prompt prefixes seen before (true: up to 4 x cache_len positions; a number: that "
        "many; false: off).")


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


def lm_new_tokens(cfg: PackageConfig, cache_len: int) -> int:
    """The most new tokens a causal LM's request may ask for."""
    return cfg.max_new_tokens or min(256, cache_len // 2)


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
    return [f"{where}.{o}: only a causal LM takes this option" for o in LM_OPTIONS
            if o in cfg.model_fields_set]


def _runtime(config: dict[str, Any], metrics: dict[str, Any]) -> str:
    from compress.recipe.kinds.export import RUNTIMES

    served = metrics.get("served_format")
    return "TorchServe .mar" + (f" ({RUNTIMES.get(served, served)})" if served else "")


SPEC = register(StageSpec(
    kind="package", config=PackageConfig, runner="compress.stages.package:run", order=70,
    makes_model=False, takes_model=False, measured=False,
    code_modules=("serve.handler", "serve.runtimes", "serve.worker_threads", "serve.batching",
                  "serve.http_answers", "compress.serving.archive"),
    runtime=_runtime,
    input_stage=export_stage_index,
    check=lambda recipe, i: (_servable(recipe, i) + _fits_the_cache(recipe, i)
                             + split_problems(recipe, i) + pipeline_problems(recipe, i)
                             + expert_problems(recipe, i)),
    check_model=lambda recipe, i, config: (split_fits_the_config(recipe, i, config)
                                           + stages_fit_the_config(recipe, i, config)
                                           + experts_fit_the_config(recipe, i, config)),
    check_task=_check_task,
    runner_code={"causal-lm": tuple(f"serve.causal_lm.{m}" for m in (
        *causal_lm_code.SERVING_MODULES, *causal_lm_code.RUNTIME_MODULES)),
                 "embedding": tuple(f"serve.embedding.{m}"
                                    for m in embedding_code.SERVING_MODULES)},
))

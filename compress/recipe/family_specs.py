"""Model families: how a kind of model loads, what data it takes and what is measured.

A family is the stage spec idea one level up. Its traits live here (no torch import); its
work lives in its package, `compress.families.<family>/`, whose `family` module
(`compress.families.classifier.family`, `compress.families.causal_lm.family`) defines the same
functions:

- `load_data(recipe, source) -> DataBundle`
- `load_model(recipe, source, data) -> ModelBundle`
- `measure(bundle, data, recipe, known, run_dir) -> metrics`
- `latency(bundle, data, recipe) -> metrics` (the input model, re-timed beside a stage)
- `compare(metrics, input_latency, input_metrics) -> metrics` (ratios and deltas)

A family says how each stage kind runs on it (`Family.stages`: the package whose module
named for the kind holds its `run`, imported when the stage runs; None: every kind through
its own spec's runner, in `compress.stages`), so the shared code does not grow branches for
other families. Lower layers (compress.models) reach a family's modules through `part` by
the names in `Family.parts`, never by importing compress.families.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from functools import cache
from types import ModuleType
from typing import Any

from compress.recipe.registry import spec_of


@dataclass(frozen=True)
class Family:
    """Everything compress knows about one model family, torch-free."""

    task: str  # the recipe's `model.task`
    noun: str  # "a classifier", "a causal LM": for messages
    module: str  # where its functions live
    headline: tuple[str, ...]  # metrics of a stage's progress line, in order
    only_options: tuple[str, ...]  # recipe options no other family takes (dotted)
    stages: str | None = None  # package of its stage runners: kind K runs on the family
    # through `<stages>.K:run` where that module exists (else the family does not take K);
    # None: every kind runs through its own StageSpec.runner (compress.stages)
    parts: dict[str, str] = field(default_factory=dict)  # name -> module, for lower layers
    shares: tuple[str, ...] = ()  # another family's only_options this one takes too


CAUSAL_LM = "compress.families.causal_lm"
EMBEDDING = "compress.families.embedding"
RERANKER = "compress.families.reranker"

FAMILIES = {
    "classification": Family(
        "classification", "a classifier", "compress.families.classifier.family",
        ("accuracy", "accuracy_delta_vs_input", "macro_f1", "latency_ms_b1", "latency_ms_b8",
         "latency_ratio_b8", "size_mb", "sparsity"),
        ("model.num_labels", "data.label_column", "data.label_names",
         "data.holdout_fraction"),
    ),
    "causal-lm": Family(
        "causal-lm", "a causal LM", f"{CAUSAL_LM}.family",
        ("perplexity", "perplexity_delta_pct", "decode_tok_s_b1", "decode_speedup_b1",
         "ttft_ms", "agreement", "next_token_agreement", "size_mb"),
        ("data.prompts", "data.chat_template", "evaluation.generation", "evaluation.lm_eval"),
        stages=f"{CAUSAL_LM}.stages",
        # save_causal_lm(bundle, folder), load_causal_lm_folder(folder)
        parts={"folder": f"{CAUSAL_LM}.folder"},
    ),
    "embedding": Family(
        "embedding", "an embedding model", f"{EMBEDDING}.family",
        ("fidelity", "fidelity_p1", "recall_at_10", "knn_accuracy", "latency_ms_b1",
         "real_items_per_s_b32", "latency_ratio_b32", "size_mb"),
        ("evaluation.mteb",),
        stages=f"{EMBEDDING}.stages",
        # save_encoder(bundle, folder), load_encoder_folder(folder)
        parts={"folder": f"{EMBEDDING}.folder"},
        shares=("data.label_column", "data.label_names"),  # labels give k-NN accuracy
    ),
    "reranking": Family(
        "reranking", "a reranker", f"{RERANKER}.family",
        ("ndcg_at_10", "mrr_at_10", "kendall_tau", "score_max_abs_diff", "latency_ms_b1",
         "real_items_per_s_b32", "latency_ratio_b32", "size_mb"),
        ("data.pair_column",),
        stages=f"{RERANKER}.stages",
        # save_cross_encoder(bundle, folder), load_reranker_folder(folder)
        parts={"folder": f"{RERANKER}.folder"},
        shares=("data.label_column",),  # a pair table's relevance
    ),
}


def family(task: str) -> Family:
    """The family of a `model.task` value."""
    return FAMILIES[task]


def functions(task: str) -> ModuleType:
    """The module with the family's functions (imports torch)."""
    return importlib.import_module(FAMILIES[task].module)


def part(task: str, name: str) -> ModuleType:
    """The family's module `name` (`Family.parts`), for a lower layer that must not import
    compress.families (imports torch)."""
    return importlib.import_module(FAMILIES[task].parts[name])


def runner_of(kind: str, task: str) -> str | None:
    """`module:function` that runs stage `kind` on a model of family `task` (None: the kind
    does not take that family)."""
    spec = spec_of(kind)
    stages = FAMILIES[task].stages
    if stages is None:
        return spec.runner
    module = f"{stages}.{kind}"
    return f"{module}:run" if _exists(module) else None


@cache
def _exists(module: str) -> bool:
    """Whether `module` can be imported (found without running it: its packages' `__init__`
    files only, which import nothing)."""
    return importlib.util.find_spec(module) is not None


def family_problems(recipe: Any, task: str) -> list[str]:
    """One line per recipe option or stage that does not fit the model's family."""
    own = FAMILIES[task]
    problems = []
    for other in FAMILIES.values():
        if other.task == task:
            continue
        for option in other.only_options:
            if _is_set(recipe, option) and option not in own.shares:
                problems.append(f"{option}: only {other.noun} takes this option, and this "
                                f"model is {own.noun} (model.task: {task}); remove it")
    for i, stage in enumerate(recipe.stages):
        if runner_of(stage.kind, task) is None:
            takes = [k for k in _kinds() if runner_of(k, task) is not None]
            problems.append(f"stages.{i} ({stage.kind}): this stage kind does not take "
                            f"{own.noun} yet (kinds that do: {', '.join(takes)})")
            continue
        hook = spec_of(stage.kind).check_task
        if hook is not None:
            problems += hook(stage, task, i)
    return problems


def _kinds() -> list[str]:
    from compress.recipe.registry import all_specs

    return list(all_specs())


def _is_set(recipe: Any, dotted: str) -> bool:
    """Whether the recipe sets `dotted` itself (a default does not count)."""
    node = recipe
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = getattr(node, part)
    return leaf in node.model_fields_set

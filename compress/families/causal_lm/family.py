"""The causal-LM family's functions (see `compress.recipe.family_specs`): text without labels,
perplexity, generation speed over a static KV cache, and agreement with the float model.

The float model measured first in a run (the baseline) is the reference: its greedy tokens,
its `generate` rate and its compiled decode rate go to `<run>/causal_lm_reference.json`, and
every later measurement is compared with them in the same run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compress.data.datasets import DataBundle, Examples, read_hub_split, read_table, seeded_subset
from compress.errors import CompressError, UserError
from compress.families.causal_lm.folder import load_recipe_causal_lm, provenance  # noqa: F401  (family function)
from compress.families.causal_lm.generation import (
    agreement,
    eager_generate_rate,
    prompt_ids,
    reference_margins,
    time_generation,
)
from compress.families.causal_lm.model import perplexity
from compress.models.bundle import ModelBundle, count_params, sparsity
from compress.recipe.chain import used_splits
from compress.recipe.datasets import split_file
from compress.runfolder.files import atomic_write_text

REFERENCE = "causal_lm_reference.json"
OLD_REFERENCE = "lm_reference.json"  # its name in run folders written before (still read)
PPL_BATCH = 8


def load_data(recipe, source) -> DataBundle:
    """The text of every split the recipe uses, and the generation prompts."""
    cfg = recipe.data
    splits = {}
    for name in used_splits(recipe):
        split = getattr(cfg, name)
        if source.kind == "files":
            table = read_table(split_file(source.location, split.split))
        else:
            table = read_hub_split(source.location, split.split)
        if table and cfg.text_column not in table[0]:
            raise UserError(f"data.text_column: column '{cfg.text_column}' not found "
                            f"(columns: {', '.join(table[0])})")
        texts = [str(r[cfg.text_column]).strip() for r in table]
        texts = seeded_subset([t for t in texts if t], split.max_samples, recipe.seed)
        if not texts:
            raise UserError(f"data.{name}: split '{split.split}' has no text")
        splits[name] = Examples(labels=[], texts=texts)
    prompts = read_prompts(cfg.prompts) if cfg.prompts else splits["eval"].texts
    count = recipe.evaluation.generation.prompts
    return DataBundle("causal-lm", splits, [], None, cfg.max_length, prompts=prompts[:count])


def calibration_blocks(tokenizer, data: DataBundle, need: str) -> Any:
    """The calibration text packed into `data.max_length` blocks (N x max_length token
    ids); `need` names what needs it, for the one-line error when there is none."""
    from compress.families.causal_lm.algorithms.distill import pack_texts

    split = data.splits.get("calibration")
    if split is None or not split.texts:
        raise CompressError(f"{need} needs calibration text (data.calibration)")
    try:
        return pack_texts(tokenizer, split.texts, data.max_length)
    except ValueError as exc:
        raise CompressError(f"data.calibration: {exc}") from None


def read_prompts(path: str) -> list[Any]:
    """Prompts from a text file (one per line) or JSONL (`prompt` or `messages` per line)."""
    file = Path(path).expanduser()
    lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if file.suffix != ".jsonl":
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            prompts.append(row["messages"] if "messages" in row else row["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"data.prompts: {file}:{number}: not a JSON object with "
                            "`prompt` or `messages`") from None
    return prompts


def load_model(recipe, source, data: DataBundle) -> ModelBundle:
    """The recipe's causal LM in float32."""
    return load_recipe_causal_lm(source.location, recipe.model.checkpoint)


def measure(bundle: ModelBundle, data: DataBundle, recipe, known: dict[str, Any] | None,
            run_dir: Path, reference: bool = False) -> dict[str, Any]:
    """Perplexity on the eval split, generation figures, agreement with the reference's
    greedy tokens (or, for the reference, its tokens written down), params and size. A
    stage that decoded its own file (`known` has its perplexity and agreement: the
    executorch export) is not decoded again here."""
    gen = recipe.evaluation.generation
    metrics: dict[str, Any] = dict(known or {})
    if "perplexity" not in metrics:
        metrics.update(perplexity(bundle.model, bundle.tokenizer, data.splits["eval"].texts,
                                  data.max_length, PPL_BATCH))
    if recipe.evaluation.lm_eval is not None and not any(k.startswith("lm_eval_")
                                                         for k in metrics):
        metrics.update(lm_eval_scores(bundle, recipe.evaluation.lm_eval))
    if "agreement" in metrics and not reference:  # the stage decoded its own file (a .pte)
        metrics["params"] = count_params(bundle.model)
        return metrics
    prompts = [prompt_ids(bundle.tokenizer, p, recipe.data.chat_template)
               for p in data.prompts]
    figures = time_generation(bundle, prompts, gen)
    tokens = figures.pop("tokens")
    if recipe.evaluation.latency.enabled:
        metrics.update(figures)
    ref_file = run_dir / REFERENCE if reference else reference_file(run_dir)
    if reference:
        ref = {"tokens": tokens, "perplexity": metrics["perplexity"],
               "decode_tok_s_b1": figures["decode_tok_s_b1"],
               "margins": reference_margins(bundle.model, prompts, tokens)}
        if gen.eager_generate and recipe.evaluation.latency.enabled:
            ref["eager_generate_tok_s_b1"] = eager_generate_rate(
                bundle.model, prompts[:3], gen.max_new_tokens)
            metrics["eager_generate_tok_s_b1"] = ref["eager_generate_tok_s_b1"]
        atomic_write_text(ref_file, json.dumps(ref))
    elif ref_file.is_file():
        ref = json.loads(ref_file.read_text())
        metrics.update(agreement(bundle.model, prompts, tokens, ref["tokens"],
                                 ref.get("margins")))
        metrics["perplexity_delta_vs_float_pct"] = round(
            100 * (metrics["perplexity"] / ref["perplexity"] - 1), 3)
        if "decode_tok_s_b1" in metrics:
            for key, name in (("decode_tok_s_b1", "float_compiled"),
                              ("eager_generate_tok_s_b1", "float_eager_generate")):
                if ref.get(key):
                    metrics[f"decode_vs_{name}"] = round(
                        metrics["decode_tok_s_b1"] / ref[key], 3)
    metrics["params"] = count_params(bundle.model)
    if not (bundle.causal_lm_facts or {}).get("scheme"):  # torchao's int tensors have no `==`
        metrics["sparsity"] = round(sparsity(bundle.model), 6)
    return metrics


def lm_eval_scores(bundle: ModelBundle, config) -> dict[str, float]:
    """The recipe's lm-eval tasks scored for the bundle's model (`evaluation.lm_eval`)."""
    try:
        from compress.families.causal_lm.evaluation_harness import task_scores
    except ImportError as exc:
        raise UserError(f"evaluation.lm_eval needs lm-eval ({exc}): pip install "
                        "'compress-pipeline[eval]'") from None
    try:
        return task_scores(bundle.model, bundle.tokenizer, config.tasks, config.limit,
                           config.include_path, config.max_length)
    except ValueError as exc:
        raise UserError(f"evaluation.lm_eval: {exc}") from None


def reference_file(run_dir: Path) -> Path:
    """The run's reference file: `REFERENCE`, or `OLD_REFERENCE` in a run folder written
    before the file took the family's name (a resumed run reads it there)."""
    old = run_dir / OLD_REFERENCE
    return old if old.is_file() and not (run_dir / REFERENCE).is_file() else run_dir / REFERENCE


def latency(bundle: ModelBundle, data: DataBundle, recipe) -> dict[str, Any]:
    """The input model's decode rate at batch 1, re-timed beside the stage (3 prompts)."""
    from dataclasses import replace

    prompts = [prompt_ids(bundle.tokenizer, p, recipe.data.chat_template)
               for p in data.prompts[:3]]
    gen = recipe.evaluation.generation.model_copy(update={"batch_sizes": [1]})
    figures = time_generation(replace(bundle), prompts, gen)
    return {"decode_tok_s_b1": figures["decode_tok_s_b1"]}


def compare(metrics: dict[str, Any], input_latency: dict[str, Any],
            input_metrics: dict[str, Any] | None) -> dict[str, Any]:
    """Perplexity change (%) and decode speedup against the stage's input."""
    out: dict[str, Any] = {}
    before = (input_metrics or {}).get("perplexity")
    if before and "perplexity" in metrics:
        out["perplexity_delta_pct"] = round(100 * (metrics["perplexity"] / before - 1), 3)
    rate = input_latency.get("decode_tok_s_b1")
    if rate:
        out["input_decode_tok_s_b1"] = rate
        if metrics.get("decode_tok_s_b1"):
            out["decode_speedup_b1"] = round(metrics["decode_tok_s_b1"] / rate, 3)
    return out

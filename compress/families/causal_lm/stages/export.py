"""Stage `export` on a causal LM (`format: transformers`): the model folder that plain
transformers + torchao load, with the `causal_lm` runtime package in it, proven by decoding.

The folder (`<stage>/transformers/`, built under a temporary name and renamed when
complete) holds what `compress.families.causal_lm.folder.save_lm` writes (config, tokenizer,
safetensors or a torchao state dict, `causal_lm.json`), the package `causal_lm/` (`runtime.py`,
`decode.py`, `attention.py`, the grouped kernels and the parallel comparisons: torch,
transformers and torchao only), `export.json` and `parity.json`.
Parity: the exported folder, read back through the runtime, encodes the recipe's prompts and
decodes them greedily, and must give the in-process model's token ids (`min_agreement` of
the positions, default all). Both decode the same way: eager, in batches of up to `PARITY_BATCH`
left-padded prompts, with no stop token, so every position is compared."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import serve.causal_lm as causal_lm_code
from compress.errors import ParityError
from compress.families.causal_lm.folder import save_lm
from compress.families.causal_lm.model import greedy_agreement
from compress.models.bundle import ModelBundle, count_params
from compress.recipe.kinds.export import LM_FORMAT, ExportConfig
from compress.runfolder.records import artifact_record
from compress.stages.context import StageContext, State
from serve.causal_lm import grouped_kernels
from serve.causal_lm import runtime as lm_runtime

PACKAGE = Path(lm_runtime.__file__).parent  # serve/causal_lm: `causal_lm/` in the folder
RUNTIME_MODULES = ("__init__", *causal_lm_code.RUNTIME_MODULES)
RUNTIME_FILES = (*(PACKAGE / f"{name}.py" for name in RUNTIME_MODULES), *grouped_kernels.SOURCES)
PARITY_BATCH = 8


def export_lm(bundle: ModelBundle, folder: Path) -> tuple[Path, dict[str, Any]]:
    """Write the causal LM of `bundle` into `folder` with the `causal_lm` package and
    export.json;
    (its weights file, facts)."""
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    began = time.perf_counter()
    weights = save_lm(bundle, tmp)
    (tmp / PACKAGE.name).mkdir()
    for code in RUNTIME_FILES:
        shutil.copy2(code, tmp / PACKAGE.name / code.name)
    facts = bundle.lm or {}
    meta = {"format": LM_FORMAT, "file": weights.name, "task": "causal-lm",
            "runtime": f"{PACKAGE.name}/runtime.py", "text": True, "label_names": [],
            "scheme": facts.get("scheme"), "dtype": facts.get("dtype", "float32"),
            "load": f"python -m {PACKAGE.name}.runtime . 'a prompt' (in this folder; or "
                    f"import {PACKAGE.name}.runtime: load_folder, StaticDecoder)"}
    (tmp / "export.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return folder / weights.name, {"export_s": round(time.perf_counter() - began, 3),
                                   "export_dir_mb": round(size / 1e6, 3)}


def greedy_tokens(model: nn.Module, prompts: list[list[int]], max_new_tokens: int,
                  cache_len: int, batch: int = PARITY_BATCH) -> list[list[int]]:
    """Greedy token ids after each prompt (eager, batches of up to `batch`, left padded,
    every row `max_new_tokens` long)."""
    tokens: list[list[int]] = []
    longest = max(len(p) for p in prompts)
    decoder = lm_runtime.StaticDecoder(model, max(cache_len, longest + max_new_tokens))
    for start in range(0, len(prompts), batch):
        tokens += decoder.generate(prompts[start:start + batch], max_new_tokens).rows
    return tokens


def parity(source: ModelBundle, exported: lm_runtime.LoadedLM, prompts: list[Any],
           chat_template: bool, max_new_tokens: int, cache_len: int,
           log: Callable[[str], None] = print) -> dict[str, Any]:
    """Prompt ids and greedy tokens of the exported folder against the source model's."""
    ids = [lm_runtime.prompt_ids(source.tokenizer, p, chat_template) for p in prompts]
    theirs = [lm_runtime.prompt_ids(exported.tokenizer, p, chat_template) for p in prompts]
    log(f"parity: decoding {len(ids)} prompts x {max_new_tokens} tokens with each model")
    want = greedy_tokens(source.model, ids, max_new_tokens, cache_len)
    got = greedy_tokens(exported.model, theirs, max_new_tokens, cache_len)
    first = next(((i, j) for i, (a, b) in enumerate(zip(want, got, strict=True))
                  for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
    return {"parity_token_agreement": round(greedy_agreement(want, got), 6),
            "parity_prompt_ids_equal": ids == theirs, "parity_prompts": len(ids),
            "parity_new_tokens": max_new_tokens,
            "parity_first_difference": None if first is None else
            {"prompt": first[0], "position": first[1], "source_token": want[first[0]][first[1]],
             "exported_token": got[first[0]][first[1]]}}


def run(state: State, cfg: ExportConfig, ctx: StageContext) -> State:
    """Export the causal LM that entered the stage (or `cfg.source`'s), prove it decodes as
    the model does, record it; the exported model goes on to be measured."""
    bundle = state.bundle
    final = ctx.folder / LM_FORMAT
    path, facts = export_lm(bundle, final)
    ctx.metrics.update(facts)
    exported = lm_runtime.load_folder(final)
    gen = ctx.recipe.evaluation.generation
    prompts = ctx.data.prompts[:cfg.parity_samples] if cfg.parity_samples else ctx.data.prompts
    figures = parity(bundle, exported, prompts, ctx.recipe.data.chat_template,
                     gen.max_new_tokens, gen.cache_len, lambda m: ctx.log(f"{ctx.name}: {m}"))
    (final / "parity.json").write_text(json.dumps(figures, indent=2))
    need = cfg.min_agreement or 1.0
    ctx.metrics.update(figures, parity_min_agreement=need, runtime=LM_FORMAT,
                       params=count_params(exported.model), runtime_threads=torch.get_num_threads())
    where = final.relative_to(ctx.run_dir)
    if not figures["parity_prompt_ids_equal"]:
        raise ParityError(f"{where}: the exported tokenizer encodes the prompts differently")
    if figures["parity_token_agreement"] < need:
        diff = figures["parity_first_difference"]
        raise ParityError(f"{where}: greedy token agreement {figures['parity_token_agreement']}"
                          f" < {need} (first difference: prompt {diff['prompt']}, token "
                          f"{diff['position']}); parity.json has the figures")
    if cfg.tensor_parallel:
        from compress.families.causal_lm.stages.export_tensor_parallel import (
            check_tensor_parallel,
        )

        check_tensor_parallel(final, cfg, prompts, ctx)
    if cfg.pipeline_parallel:
        from compress.families.causal_lm.stages.export_pipeline_parallel import (
            check_pipeline_parallel,
        )

        check_pipeline_parallel(final, cfg, prompts, ctx)
    if cfg.expert_parallel:
        from compress.families.causal_lm.stages.export_expert_parallel import (
            check_expert_parallel,
        )

        check_expert_parallel(final, cfg, prompts, ctx)
    ctx.add_output(artifact_record(path, ctx.run_dir, LM_FORMAT, export_dir=str(where)))
    return State(ModelBundle(exported.model, "causal-lm", [], tokenizer=exported.tokenizer,
                             lm=exported.facts))

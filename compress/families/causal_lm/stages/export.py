"""Stage `export` on a causal LM (`format: transformers`): the model folder that plain
transformers + torchao load, with the `causal_lm` runtime package in it, proven by decoding.

The folder (`<stage>/transformers/`, built under a temporary name and renamed when
complete) holds what `compress.families.causal_lm.folder.save_causal_lm` writes (config, tokenizer,
safetensors or a torchao state dict, `causal_lm.json`), the package `causal_lm/` with
`serve/causal_lm/runtime/` whole in it (the loader, the decoder, the weight schemes, the
kernels' sources and the parallel comparisons: torch, transformers and torchao only),
`export.json` and `parity.json`.
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

from compress.errors import ParityError
from compress.families.causal_lm.folder import save_causal_lm
from compress.families.causal_lm.model import greedy_agreement
from compress.families.causal_lm.stages.export_parallel import check_splits
from compress.models.bundle import ModelBundle, count_params
from compress.recipe.kinds.export import (
    CAUSAL_LM_FORMAT,
    COMPRESSED_TENSORS_FORMAT,
    EXECUTORCH_FORMAT,
    GGUF_FORMAT,
    SPEC,
    ExportConfig,
)
from compress.runfolder.code_digest import shipped_files
from compress.runfolder.records import artifact_record
from compress.stages.context import StageContext, State
from serve.causal_lm import runtime

(RUNTIME,) = SPEC.shipped_code["causal-lm"]  # shipped whole as the folder's causal_lm/runtime/
PACKAGE = Path(runtime.__file__).parent.parent  # serve/causal_lm: `causal_lm/` in the folder
PARITY_BATCH = 8


def export_causal_lm(bundle: ModelBundle, folder: Path) -> tuple[Path, dict[str, Any]]:
    """Write the causal LM of `bundle` into `folder` with the `causal_lm` package and
    export.json;
    (its weights file, facts)."""
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    began = time.perf_counter()
    weights = save_causal_lm(bundle, tmp)
    for code in (PACKAGE / "__init__.py", *shipped_files(RUNTIME)):
        target = tmp / PACKAGE.name / code.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(code, target)
    facts = bundle.causal_lm_facts or {}
    meta = {"format": CAUSAL_LM_FORMAT, "file": weights.name, "task": "causal-lm",
            "runtime": f"{PACKAGE.name}/runtime/", "text": True, "label_names": [],
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
    decoder = runtime.StaticDecoder(model, max(cache_len, longest + max_new_tokens))
    for start in range(0, len(prompts), batch):
        tokens += decoder.generate(prompts[start:start + batch], max_new_tokens).rows
    return tokens


def parity(source: ModelBundle, exported: runtime.LoadedCausalLM, prompts: list[Any],
           chat_template: bool, max_new_tokens: int, cache_len: int,
           log: Callable[[str], None] = print) -> dict[str, Any]:
    """Prompt ids and greedy tokens of the exported folder against the source model's."""
    ids = [runtime.prompt_ids(source.tokenizer, p, chat_template) for p in prompts]
    theirs = [runtime.prompt_ids(exported.tokenizer, p, chat_template) for p in prompts]
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
    the model does, record it; the exported model goes on to be measured. Format gguf: one
    file for llama.cpp (`compress.families.causal_lm.llama_cpp`); compressed_tensors: the
    checkpoint vLLM and transformers load (`compress.families.causal_lm.compressed_tensors`);
    executorch: a .pte for ExecuTorch (`compress.families.causal_lm.executorch`)."""
    if cfg.format == GGUF_FORMAT:
        from compress.families.causal_lm import llama_cpp

        return llama_cpp.run(state, cfg, ctx)
    if cfg.format == COMPRESSED_TENSORS_FORMAT:
        from compress.families.causal_lm import compressed_tensors

        return compressed_tensors.run(state, cfg, ctx)
    if cfg.format == EXECUTORCH_FORMAT:
        from compress.families.causal_lm import executorch

        return executorch.run(state, cfg, ctx)
    bundle = state.bundle
    final = ctx.folder / CAUSAL_LM_FORMAT
    path, facts = export_causal_lm(bundle, final)
    ctx.metrics.update(facts)
    exported = runtime.load_folder(final)
    gen = ctx.recipe.evaluation.generation
    prompts = ctx.data.prompts[:cfg.parity_samples] if cfg.parity_samples else ctx.data.prompts
    figures = parity(bundle, exported, prompts, ctx.recipe.data.chat_template,
                     gen.max_new_tokens, gen.cache_len, lambda m: ctx.log(f"{ctx.name}: {m}"))
    (final / "parity.json").write_text(json.dumps(figures, indent=2))
    need = cfg.min_agreement or 1.0
    ctx.metrics.update(figures, parity_min_agreement=need, runtime=CAUSAL_LM_FORMAT,
                       params=count_params(exported.model), runtime_threads=torch.get_num_threads())
    where = final.relative_to(ctx.run_dir)
    if not figures["parity_prompt_ids_equal"]:
        raise ParityError(f"{where}: the exported tokenizer encodes the prompts differently")
    if figures["parity_token_agreement"] < need:
        diff = figures["parity_first_difference"]
        raise ParityError(f"{where}: greedy token agreement {figures['parity_token_agreement']}"
                          f" < {need} (first difference: prompt {diff['prompt']}, token "
                          f"{diff['position']}); parity.json has the figures")
    check_splits(final, cfg, prompts, ctx)  # tensor_parallel..., each against one process
    ctx.add_output(artifact_record(path, ctx.run_dir, CAUSAL_LM_FORMAT, export_dir=str(where)))
    return State(ModelBundle(exported.model, "causal-lm", [], tokenizer=exported.tokenizer,
                             causal_lm_facts=exported.facts))

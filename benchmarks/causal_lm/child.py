"""One fresh process of benchmarks/causal_lm/peers.py on compress's side: `python -m
benchmarks.causal_lm.child SPEC_JSON` prints one JSON line (the figures, or {"error": one
line}); the rest goes to stderr. (llama.cpp's side is llama_child.py, run by the llama
environment's Python.)

Two modes:
- "compress": SmolLM2 loaded from the GGUF (`load_causal_lm`, dequantized to float32) or a
  stage's folder (`load_folder`), a weight scheme applied as the quantize stage does it
  (as benchmarks/causal_lm/micro/decode.py does; a `_a8` / `_bf16` variant in the opt-in
  int8- / bf16-activation mode),
  `StaticDecoder` compiled (or, with `step` "aoti", decoding through AOTInductor packages
  exported into `aoti_dir` once, as the package stage ships them); then perplexity and greedy
  tokens (when asked), decode tok/s at batch 1 and 8, time to first token (`ttft_ms`: the
  prefill a served archive runs by default, `served_prefill`: ahead of time beside "aoti"
  steps, else eager; with `ttft_compiled`, also `ttft_compiled_ms`, torch.compile's
  prefill, which is not the served default), and the
  weight bytes a decode step reads.
- "triad": memory bandwidth, a = b + s * c on float32 arrays far larger than the caches,
  on all cores, and the machine (CPU, flags, library versions).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.harness.child_main import run_in_compress
from compress.families.causal_lm.model import (
    StaticDecoder,
    load_causal_lm,
    perplexity,
    quantize_weights,
)
from compress.families.causal_lm.stages.quantize import activation_dtype
from serve.causal_lm.runtime.experts import GroupedExperts, is_experts
from serve.causal_lm.runtime.loading import DTYPES, load_folder
from serve.causal_lm.server.prefill import Prefiller

FLOAT, INT4 = "float", "int4_weight_only"
# a grouped scheme's variants in the opt-in activation modes: suffix -> mode
MODES = {"_a8": "int8", "_bf16": "bf16"}
VARIANTS = (FLOAT, "int8_grouped", "int4_grouped", INT4, "int8_sparse24", "int4_sparse24",
            *(f"{scheme}{suffix}" for suffix in MODES
              for scheme in ("int8_grouped", "int4_grouped")))  # compress's rows
TRIAD_FLOATS = 1 << 25  # 128 MiB an array, three arrays: far past any L3


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's data; a tensor subclass (torchao's packed int4) counts the
    tensors it is made of."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def weight_bytes_per_token(model: nn.Module) -> int:
    """Weight bytes one decode step reads: every tensor of the state dict once (a tied
    tensor once), except the input embedding's, of which one row is read, unless the
    output projection shares them; a grouped Linear that the kernel multiplies counts its
    kernel records (`packed`: codes, scales and offsets as the kernel reads them) instead
    of its codes, scales and offsets (a fused block's group its parts' records), and so does
    a 2:4 Linear (`sparse24.py`: kept codes, positions and scales); a mixture of experts'
    layer counts top_k / experts of its experts' tensors (a token reads its routed experts'
    records only: `experts.py`; the grouped ones' records where the kernel multiplies)."""
    embed = model.get_input_embeddings()
    in_embed = {id(m) for m in embed.modules()}  # a grouped table is read a row, not packed
    kernel = [m for m in model.modules()
              if getattr(m, "packed", None) is not None and id(m) not in in_embed]
    # a fused projection's records are its block's group's (serve/causal_lm/runtime/fused.py)
    kernel_ids = {id(m) for m in kernel}
    replaced = {id(getattr(m, name)) for m in model.modules()
                if (id(m) in kernel_ids or getattr(m, "fused", False)) and hasattr(m, "qweight")
                for name in ("qweight", "scale", "offset", "positions")  # positions: 2:4's
                if getattr(m, name, None) is not None}
    head = model.get_output_embeddings()
    head_ids = {id(t) for t in (head.state_dict(keep_vars=True).values() if head else [])}
    embed_tensors = list(embed.state_dict(keep_vars=True).values())
    rows = max((t.shape[0] for t in embed_tensors if t.dim() > 1), default=1)
    own = {id(t) for t in embed_tensors} - head_ids  # the embedding's alone: one row read
    seen, total = set(replaced), sum(tensor_bytes(m.packed) for m in kernel)
    seen_experts, routed = expert_bytes_per_token(model)
    seen |= seen_experts
    total += routed
    for tensor in model.state_dict(keep_vars=True).values():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        size = tensor_bytes(tensor)
        total += size // rows if id(tensor) in own else size
    return total


def expert_bytes_per_token(model: nn.Module) -> tuple[set[int], int]:
    """(ids of the experts' tensors, the bytes of them a token reads: top_k / experts of
    each layer's, the kernel's records where a grouped layer has them)."""
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    ids, total = set(), 0
    for module in model.modules():
        if not is_experts(module) or not top_k:
            continue
        tensors = list(module.state_dict(keep_vars=True).values())
        ids |= {id(t) for t in tensors}
        read = ([module.gate_up_packed, module.down_packed]
                if isinstance(module, GroupedExperts) and module.gate_up_packed is not None
                else tensors)
        count = module.num_experts if isinstance(module, GroupedExperts) else \
            module.gate_up_proj.shape[0]
        total += sum(tensor_bytes(t) for t in read) * min(top_k, count) // count
    return ids, total


def load_variant(source: str, variant: str) -> tuple[nn.Module, Any]:
    """(model, tokenizer): the float model from `source` (a GGUF or a float folder, such as
    a 2:4-pruned model's), a scheme applied as the quantize stage does it; with `variant`
    "folder", a stage's exported folder as it is."""
    if variant == "folder":
        lm = load_folder(source)
        return lm.model, lm.tokenizer
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} (known: {', '.join(VARIANTS)})")
    lm = load_causal_lm(source)
    suffix = next((s for s in MODES if variant.endswith(s)), "")
    scheme = variant.removesuffix(suffix)
    if variant != FLOAT:
        dtype = DTYPES[activation_dtype("auto", scheme)]
        for parameter in lm.model.parameters():
            parameter.data = parameter.data.to(dtype)
        quantize_weights(lm.model, scheme, activations=MODES.get(suffix, "float32"))
    return lm.model, lm.tokenizer


def _decoder(model: nn.Module, longest: int, mode: str, step: str, rows: int = 1,
             aoti_dir: str | None = None) -> StaticDecoder:
    """A decoder compiled in `mode`. `step` cpp: Inductor's C++ wrapper and guards checked
    on each generation's first step only (`StaticDecoder.compile`); aoti: the AOTInductor
    packages in `aoti_dir` for `rows` (exported there first where absent, as the package
    stage does it: `aot_steps`), no Dynamo between tokens; python: torch.compile's Python
    wrapper."""
    cache_len = max(512, longest + 8)
    if step == "aoti" and mode != "none":
        from serve.causal_lm.server import aot_steps

        folder = Path(aoti_dir or ".") / f"rows_{rows}"
        if not (folder / (aot_steps.ONE if rows == 1 else aot_steps.ROWS)).is_file():
            folder.mkdir(parents=True, exist_ok=True)
            aot_steps.export_steps(model, rows, cache_len, mode, folder)
        package = aot_steps.load_steps(folder, model)[min(rows, 2)]
        decoder = StaticDecoder(model, cache_len, always_mask=True)
        if rows > 1:
            decoder.allocate(rows, dynamic_rows=True)
        return aot_steps.use_step(decoder, package)
    decoder = StaticDecoder(model, max_cache_len=cache_len)
    if mode == "none":
        return decoder
    cpp = step == "cpp"
    return decoder.compile(mode, cpp_wrapper=cpp, skip_guards=cpp)


def served_prefiller(model: nn.Module, cache_len: int, aoti_dir: Path | None) -> Any:
    """The prefiller a served archive builds by default (`prefiller_of` with the default
    handler settings), without the prefix cache, which would answer a repeated prompt from
    memory: where the decode steps ship compiled ahead of time (`aoti_dir`: step "aoti"),
    through the prefill package the package stage ships beside them (`prefill_compile`,
    exported into `aoti_dir` once), else eager."""
    import dataclasses

    from serve.causal_lm.server import aot_steps
    from serve.causal_lm.server.prefill import last_only, prefiller_of
    from serve.handler_settings import HandlerSettings

    settings = dataclasses.replace(HandlerSettings(), prefix_cache=False)
    package = None
    if aoti_dir is not None and settings.prefill_compile:
        folder = aoti_dir / "prefill"
        if not (folder / aot_steps.PREFILL).is_file():
            folder.mkdir(parents=True, exist_ok=True)
            aot_steps.export_prefill(model, 1, cache_len, "default", folder, last_only(model))
        package = aot_steps.LoadedPrefill(aot_steps.load_prefill(folder, model), 1,
                                          last_only(model))
    return prefiller_of(model, settings, cache_len, package)


def ttft_ms(model: nn.Module, prefiller: Any, prompt: list[int], repeats: int) -> float:
    """Median milliseconds from a prompt to its first token through `prefiller` (a served
    worker's `Prefiller`, warmed up: one chunk for the whole prompt, as the batcher runs a
    lone request's, then the argmax)."""
    from serve.causal_lm.runtime.attention import attention, decode_attention_for
    from serve.causal_lm.server.rows import Row

    prefiller.warm_up()
    times = []
    with torch.inference_mode(), attention(model, decode_attention_for(model)):
        for _ in range(repeats + 1):  # the first compiles for this length's guards, if any
            job = prefiller.start([Row(list(prompt), 1, lambda token, end: None)])
            began = time.perf_counter()
            prefiller.step(job, whole=True)
            int(job.logits.argmax(-1)[0])
            times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times[1:])


def ttft_figures(model: nn.Module, cache_len: int, prompt: list[int], repeats: int,
                 aoti_dir: Path | None, step_compiled: bool, also_compiled: bool
                 ) -> dict[str, Any]:
    """`ttft_ms` through the served default prefill (`served_prefiller`; `served_prefill`:
    its kind, "ahead of time" or "eager"); with `also_compiled`, where the step compiles,
    `ttft_compiled_ms` through torch.compile's prefill too (not the served default)."""
    served = served_prefiller(model, cache_len, aoti_dir)
    figures: dict[str, Any] = {"ttft_ms": ttft_ms(model, served, prompt, repeats),
                               "served_prefill": served.kind}
    if also_compiled and step_compiled and not served.compiled:
        compiled = Prefiller(model, cache_len, compiled=True)
        figures["ttft_compiled_ms"] = ttft_ms(model, compiled, prompt, repeats)
    return figures


def compress(spec: dict[str, Any]) -> dict[str, Any]:
    """Load, quantize and measure one compress variant (see the module's docstring)."""
    inputs = json.loads(Path(spec["inputs"]).read_text())
    torch.set_num_threads(spec.get("threads") or os.cpu_count() or 1)
    began = time.perf_counter()
    model, tokenizer = load_variant(spec["source"], spec["variant"])
    figures: dict[str, Any] = {"load_s": round(time.perf_counter() - began, 3),
                               "bytes_per_token": weight_bytes_per_token(model),
                               "threads": torch.get_num_threads()}
    tokens, repeats, prompts = spec["tokens"], spec.get("repeats", 3), inputs["prompts"]
    longest = max(len(p) for p in [*prompts, inputs["ttft_prompt"]]) + tokens
    mode = spec.get("compile", "max-autotune")
    step = spec.get("step") or ("cpp" if spec.get("cpp_step") else "python")
    decoder = _decoder(model, longest, mode, step, 1, spec.get("aoti_dir"))
    if spec.get("quality"):
        figures.update(perplexity(model, tokenizer, inputs["texts"]))
        if figures["eval_tokens"] != inputs["eval_tokens"]:
            raise AssertionError(f"perplexity scored {figures['eval_tokens']} tokens, the "
                                 f"GGUF's tokenizer gives {inputs['eval_tokens']}")
        figures["greedy"] = [decoder.generate([p], spec["greedy_tokens"]).tokens
                             for p in prompts]
    timing = prompts[0]
    decoder.generate([timing], 4)  # warm-up (and the compile, when not done above)
    runs = [decoder.generate([timing], tokens) for _ in range(repeats)]
    figures["tok_s_b1"] = statistics.median(r.decode_tokens_per_s for r in runs)
    shipped = step == "aoti" and mode != "none"  # the prefill ships beside such steps
    figures.update(ttft_figures(model, decoder.max_cache_len, inputs["ttft_prompt"], repeats,
                                Path(spec.get("aoti_dir") or ".") if shipped else None,
                                mode != "none", bool(spec.get("ttft_compiled"))))
    batch = prompts[:spec.get("batch", 8)]
    decoder = _decoder(model, longest, mode, step, len(batch), spec.get("aoti_dir"))
    decoder.generate(batch, 4)  # warm-up
    runs = [decoder.generate(batch, tokens) for _ in range(repeats)]
    figures["tok_s_b8"] = statistics.median(r.decode_tokens_per_s for r in runs)
    if spec.get("quality"):  # checked against batch 1's greedy tokens by the parent
        figures["b8_rows"] = runs[0].rows
    return {**figures, "pid": os.getpid()}


def triad(spec: dict[str, Any]) -> dict[str, Any]:
    """Best GB/s of a = b + s * c (3 arrays x 4 bytes a float moved a pass) on all cores."""
    from compress.runfolder.files import environment

    torch.set_num_threads(spec.get("threads") or os.cpu_count() or 1)
    n = spec.get("floats") or TRIAD_FLOATS
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    torch.add(b, c, alpha=3.0, out=a)  # first touch of every page
    best, began = float("inf"), time.perf_counter()
    while time.perf_counter() - began < spec.get("seconds", 2.0):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - start)
    return {"triad_gbs": round(3 * 4 * n / best / 1e9, 2), "floats": n,
            "threads": torch.get_num_threads(), "environment": environment(),
            "pid": os.getpid()}


def main(argv: list[str] | None = None) -> int:
    """Run the spec's mode and print its JSON line; 1 with {"error": ...} when it fails."""
    return run_in_compress(lambda spec: triad(spec) if spec.get("mode") == "triad"
                           else compress(spec), argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())

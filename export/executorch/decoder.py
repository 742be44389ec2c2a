"""A causal LM as one ExecuTorch program (`model.pte`), for phones and edge CPUs.

Its linear layers take XNNPACK's dynamic-activation schemes through torchao
(`Int8DynamicActivationIntxWeightConfig`): `8da4w`, activations rounded to int8 per token at
each call and weights to int4, symmetric, one scale per group of 32 inputs (the output
projection int8, `HEAD`); `8da8w`, int8 weights with one scale per output channel; none:
float32. The embedding table stays float. XNNPACK stores a group's scale as a bfloat16.
`torch.export` captures the model over a static KV cache held in the program (transformers'
`TorchExportableModuleWithStaticCache`), with `input_ids` 1 x n and `cache_position` n (1 to
`MAX_SEQ` tokens a call: a prompt in slices of MAX_SEQ, then one token a call), and the
logits of those n tokens come back; XNNPACK takes the linear layers and the attention
products (export.executorch.lowering), ExecuTorch's portable kernels the rest (the cache
writes, RMSNorm's mean, the mask).

A model with compress's grouped layers (serve.causal_lm.runtime.grouped) is dequantized to
float first: their custom operators cannot be lowered to XNNPACK, so the scheme rounds their
values again on its own grid (int4_grouped's affine 16 levels become 8da4w's symmetric
ones), and the parity of the stage says what that cost. The program also answers ExecuTorch's
LLM runner (`get_max_seq_len`, `get_max_context_len`, `get_eos_ids`, ...), and export.json
holds the same for any other runner.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from export.errors import CaptureError, ExportError, one_line
from export.executorch.lowering import EXTRA, FILE, lowering
from export.random_ops import fx_random_nodes, refuse_random_ops
from serve.causal_lm.runtime.fused import FusableLinear, unfuse_blocks
from serve.causal_lm.runtime.grouped import GroupedEmbedding
from serve.causal_lm.runtime.loading import stop_ids

SCHEMES = ("8da4w", "8da8w")  # int8 dynamic activations; int4 weights per 32, int8 per channel
GROUP = 32  # 8da4w's weights per scale
# the output projection's weight bits under a scheme, where not the scheme's: int4 there
# took SmolLM2-135M's perplexity on SST-2 from 375 to 596 under 8da4w, int8 to 492 (float: 485)
HEAD = {"8da4w": 8}
MAX_SEQ = 128  # tokens one call takes (the program plans its memory for this many)
INSTEAD = "format transformers or gguf"  # a causal LM's other formats


def float_model(model: nn.Module) -> tuple[nn.Module, int]:
    """A float32 copy of `model` for capture, its kernel layers (the grouped and 2:4 Linears,
    the grouped embedding) turned back into nn.Linear / nn.Embedding of their dequantized
    values and its fused blocks unfused; and how many layers were dequantized. ExportError
    for weights only torchao can read (its quantized tensors)."""
    copied = copy.deepcopy(model).eval().requires_grad_(False)
    tables = [name for name, m in copied.named_modules() if isinstance(m, GroupedEmbedding)]
    kernels = [(name, m) for name, m in copied.named_modules()
               if isinstance(m, FusableLinear | GroupedEmbedding)
               and not any(name.startswith(f"{table}.") for table in tables)]
    for name, module in kernels:  # dequantized before unfusing: a fused part's records
        parent, _, leaf = name.rpartition(".")  # are in its block's group
        if isinstance(module, GroupedEmbedding):
            weight = module.table.dequantize()
            plain: nn.Module = nn.Embedding(*weight.shape, _weight=weight)
        else:
            plain = nn.Linear(module.in_features, module.out_features,
                              bias=module.bias is not None)
            plain.weight.data = module.dequantize().float()
            if module.bias is not None:
                plain.bias.data = module.bias.detach().float()
        setattr(copied.get_submodule(parent) if parent else copied, leaf,
                plain.requires_grad_(False))
    unfuse_blocks(copied)
    held = next(((name, type(p.data).__name__) for name, p in copied.named_parameters()
                 if type(p.data) is not torch.Tensor), None)
    if held is not None:
        raise ExportError(f"executorch quantizes a float causal LM (or compress's grouped "
                          f"layers), and {held[0]} is a {held[1]}; export the model of a "
                          "stage before the quantize stage (source)")
    return copied.float(), len(kernels)


def quantize_linears(model: nn.Module, scheme: str) -> int:
    """Every nn.Linear of `model` on XNNPACK's `scheme` (torchao, in place), the output
    projection int8 per channel under 8da4w (`HEAD`); how many Linears."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerAxis, PerGroup

    if scheme not in SCHEMES:
        raise ExportError(f"executorch quantize: {scheme} is not a causal LM's scheme; use "
                          f"{' or '.join(SCHEMES)}")

    def config(bits: int) -> Any:
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4 if bits == 4 else torch.int8,
            weight_granularity=PerGroup(GROUP) if bits == 4 else PerAxis(0))

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    bits = 4 if scheme == "8da4w" else 8
    quantize_(model, config(bits), filter_fn=lambda m, _: isinstance(m, nn.Linear)
              and m is not head)
    if isinstance(head, nn.Linear):
        quantize_(model, config(HEAD.get(scheme, bits)), filter_fn=lambda m, _: m is head)
    return len(linears)


def with_static_cache(model: nn.Module, max_cache_len: int) -> nn.Module:
    """transformers' exportable wrapper: `forward(input_ids, cache_position)` over a static
    KV cache of `max_cache_len` positions at batch 1."""
    from transformers import GenerationConfig
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    return TorchExportableModuleWithStaticCache(model, batch_size=1,
                                                max_cache_len=max_cache_len).eval()


def capture(module: nn.Module, max_seq: int) -> torch.export.ExportedProgram:
    """`torch.export` (strict: the cache's tensors then stay the program's mutated buffers)
    with 1 to `max_seq` tokens a call; CaptureError in one line."""
    tokens = torch.export.Dim("tokens", min=1, max=max_seq)
    ids = torch.zeros(1, 2, dtype=torch.long)
    try:
        return torch.export.export(module, (), {"input_ids": ids,
                                                "cache_position": torch.arange(2)},
                                   dynamic_shapes={"input_ids": {1: tokens},
                                                   "cache_position": {0: tokens}},
                                   strict=True)
    except Exception as exc:  # any capture failure: the architecture, guards, unsupported ops
        raise CaptureError(f"torch.export could not capture the causal LM with a static "
                           f"cache: {one_line(exc)}") from None


def export_causal_lm(model: nn.Module, tokenizer: Any, folder: Path, quantize: str | None,
                     max_cache_len: int, log: Callable[[str], None] = print
                     ) -> tuple[Path, dict[str, Any]]:
    """Write `model` (float, or with grouped layers) as `model.pte` in `folder` with
    export.json and the tokenizer files (built under a temporary name, then renamed);
    the file and what was done."""
    lower = lowering(INSTEAD)
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    plain, dequantized = float_model(model)
    if dequantized:
        log(f"{dequantized} grouped layers dequantized to float: compress's grouped operators "
            f"cannot be lowered to XNNPACK, so {quantize or 'float32'} holds their values"
            + (" rounded again on its own grid" if quantize else ""))
    linears = quantize_linears(plain, quantize) if quantize else 0
    if quantize:
        log(f"{linears} linear layers on XNNPACK's {quantize} (int8 dynamic activations, "
            + ("int4 weights per group of 32, the output projection's int8 per channel)"
               if quantize == "8da4w" else "int8 weights per channel)"))
    max_seq = min(MAX_SEQ, max_cache_len)
    program = capture(with_static_cache(plain, max_cache_len), max_seq)
    refuse_random_ops(fx_random_nodes(program.graph), "the executorch graph")
    config = plain.config
    eos = sorted(stop_ids(plain, tokenizer))
    bos = tokenizer.bos_token_id
    runner = {"get_max_seq_len": max_seq, "get_max_context_len": max_cache_len,
              "get_vocab_size": int(config.vocab_size), "use_kv_cache": True,
              "use_sdpa_with_kv_cache": False, "enable_dynamic_shape": True}
    if bos is not None:
        runner["get_bos_id"] = int(bos)
    if eos:  # a model without an end token decodes to its limit
        runner["get_eos_ids"] = eos
    buffer, delegated, missing = lower(program, runner)
    if missing:
        raise ExportError(f"executorch: ExecuTorch's runtime has no kernel for "
                          f"{', '.join(missing)}; export with {INSTEAD}")
    path = tmp / FILE
    path.write_bytes(buffer)
    facts = {"executorch_quantize": quantize or "float32",
             "executorch_max_cache_len": max_cache_len, "executorch_max_seq": max_seq,
             "executorch_delegated": delegated, "executorch_quantized_linears": linears,
             "executorch_dequantized_layers": dequantized}
    meta = {"format": "executorch", "file": FILE, "task": "causal-lm", "text": True,
            "inputs": ["input_ids", "cache_position"], "outputs": ["logits"],
            "label_names": [], "vocab_size": int(config.vocab_size),
            "eos_token_ids": eos, "bos_token_id": bos, **facts,
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "load": "export.executorch.decoder.PteCausalLM(folder), or ExecuTorch's LLM "
                    "runner (executorch.extension.llm.runner.TextLLMRunner(model.pte, "
                    "tokenizer.json))"}
    (tmp / "export.json").write_text(json.dumps(meta, indent=2))
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder / FILE, facts


class PteCausalLM:
    """A causal-LM `.pte` in `executorch.runtime`: the logits of a sequence (fed in slices of
    the program's bound) and greedy decoding over the program's own KV cache, one token a
    call. `__call__(input_ids, attention_mask=None)` gives `.logits` as a Hugging Face model
    does, one unpadded row at a time (for perplexity)."""

    def __init__(self, folder: Path, threads: int | None = None):
        try:
            from executorch.extension.pybindings import portable_lib
            from executorch.runtime import Runtime
        except ImportError as exc:
            raise ExportError(f"a causal-LM .pte needs ExecuTorch ({one_line(exc)}): {EXTRA}"
                              ) from None
        folder = Path(folder)
        self.meta = json.loads((folder / "export.json").read_text())
        if threads and portable_lib._threadpool_get_thread_count() != threads:
            portable_lib._unsafe_reset_threadpool(threads)
        try:
            self.method = Runtime.get().load_program(folder / self.meta["file"]
                                                     ).load_method("forward")
        except Exception as exc:  # a corrupt or foreign program
            raise ExportError(f"ExecuTorch could not load {folder / self.meta['file']}: "
                              f"{one_line(exc)}") from None
        self.max_seq = int(self.meta["executorch_max_seq"])
        self.max_cache_len = int(self.meta["executorch_max_cache_len"])
        self.calls = 0

    def forward(self, ids: list[int], start: int = 0) -> torch.Tensor:
        """len(ids) x vocabulary float32 logits of `ids` written into the cache from
        position `start` (what the cache holds before `start` is their context)."""
        if start + len(ids) > self.max_cache_len:
            raise ExportError(f"{start + len(ids)} positions exceed the program's KV cache "
                              f"of {self.max_cache_len}")
        out = []
        for at in range(0, len(ids), self.max_seq):
            chunk = ids[at:at + self.max_seq]
            try:
                (logits,) = self.method.execute([
                    torch.tensor([chunk], dtype=torch.long),
                    torch.arange(start + at, start + at + len(chunk), dtype=torch.long)])
            except Exception as exc:  # the runtime's own failure, one line
                raise ExportError(f"ExecuTorch could not run the program: {one_line(exc)}"
                                  ) from None
            self.calls += 1
            out.append(logits[0].clone())
        return torch.cat(out)

    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy tokens after `prompt`, `max_new_tokens` of them (no stop token)."""
        first = int(self.forward(prompt)[-1].argmax())
        return [first] + self.generate_after(prompt, first, max_new_tokens - 1)

    def generate_after(self, prompt: list[int], token: int, count: int) -> list[int]:
        """`count` greedy tokens after `token`, the first after `prompt` (whose prefill the
        cache holds), one a call."""
        tokens = []
        for position in range(len(prompt), len(prompt) + count):
            token = int(self.forward([token], position)[-1].argmax())
            tokens.append(token)
        return tokens

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                 ) -> SimpleNamespace:
        rows = []
        for i, row in enumerate(input_ids):
            keep = row if attention_mask is None else row[attention_mask[i].bool()]
            if len(keep) != len(row):
                raise ValueError("PteCausalLM scores unpadded rows only (batch size 1)")
            rows.append(self.forward(keep.tolist()))
        return SimpleNamespace(logits=torch.stack(rows))

"""A causal LM as a compressed-tensors checkpoint: the folder vLLM, SGLang and transformers
(with the `compressed-tensors` package) load, its grouped weights packed as the format's
`pack-quantized` layout. Written with safetensors and json alone (the package is needed to
load the folder, not to write it).

What goes where:
- every `GroupedLinear` (the decoder's projections and a quantized head) →
  `<name>.weight_packed` (int32, 32 / bits codes a word, code i of a row at bits i x bits,
  each code + 2^(bits-1) unsigned), `<name>.weight_scale` (float32, out x groups),
  `<name>.weight_shape` (int64), and, for 4 bits, `<name>.weight_zero_point` (integer zero
  points, packed the same way along the output rows). The format's value of a code q is
  (q - zero point) x scale.
  - `int8_grouped`: symmetric (no zero point: vLLM's int8 weight-only kernels take none).
    A group already on that grid (offset 0, a float16 scale: `grid: compressed_tensors` or
    `gguf`, or a GGUF's Q8_0) is copied; any other is re-rounded from its values.
  - `int4_grouped`: affine with an integer zero point. A group whose minimum is -z x step
    for an integer z in 0..15 (`grid: compressed_tensors`) is copied; a GGUF's Q4_1 group
    (a free float16 minimum) is re-rounded.
  Re-rounded groups are counted and the largest change to a weight reported.
- the input embedding → float32 (its int8 groups dequantized exactly: the format quantizes
  Linears only); every other tensor (norms) → float32 as it is.
- the output head → nothing when its values are the embedding's (`tie_word_embeddings`:
  a grouped head fitted on the same grid as the embedding is); else quantized when it has
  the decoder's bit width, float32 otherwise (transformers' dequantizing loader reads one
  scheme for every module, so an int8 head under int4 layers stays out of it: `ignore`).
- `config.json` → the model's config with `quantization_config` (one config group per bit
  width, its targets the modules' names).

Refused, one line each (`CompressedTensorsError`): a model without grouped weights (nothing
to compress: export format transformers), 2:4 sparse weights and mixture-of-experts layers
(not written here), feed-forward widths or head counts that differ between layers (a
transformers config holds one of each).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from export.errors import ExportError
from serve.causal_lm.runtime.experts import is_experts
from serve.causal_lm.runtime.grouped import (
    GroupedEmbedding,
    GroupedLinear,
    dense_weight,
    fit_groups,
)
from serve.causal_lm.runtime.sparse24 import Sparse24Linear

FORMAT = "pack-quantized"
GRID = "compressed_tensors"  # fit_groups' grid of this format
WEIGHTS = "model.safetensors"
CHECKPOINT_VERSION = "0.20.1"  # the compressed-tensors release the layout was checked with


class CompressedTensorsError(ExportError):
    """What a compressed-tensors checkpoint cannot hold, in one line."""


@dataclass
class Written:
    """What writing the folder did: the modules by bit width, and the groups re-rounded."""

    folder: Path
    modules: dict[int, list[str]] = field(default_factory=dict)  # bits -> module names
    groups: int = 0
    rerounded: int = 0
    max_rounding: float = 0.0

    def facts(self) -> dict[str, Any]:
        return {"ct_modules": {f"int{bits}": len(names) for bits, names in
                               sorted(self.modules.items())},
                "ct_groups": self.groups, "ct_rerounded_groups": self.rerounded,
                "ct_max_rounding": round(self.max_rounding, 9)}


def pack_codes(unsigned: torch.Tensor, bits: int) -> torch.Tensor:
    """rows x n codes already offset to 0..2^bits - 1 → rows x ceil(n x bits / 32) int32
    words, code i at bit (i mod 32 / bits) x bits of word i x bits // 32 (the format's dense
    packing, for the bit widths that divide 32)."""
    per_word = 32 // bits
    rows, cols = unsigned.shape
    padded = -(-cols // per_word) * per_word
    values = np.zeros((rows, padded), dtype=np.uint32)
    values[:, :cols] = unsigned.numpy().astype(np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    words = (values.reshape(rows, -1, per_word) << shifts).sum(-1, dtype=np.uint64)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def on_grid(module: GroupedLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor]:
    """(unsigned codes, scale, zero point, whether each group was on the format's grid) of a
    grouped module, off-grid groups re-fitted from their values."""
    _, scale, offset = module.sources()
    codes = module.codes().to(torch.int32)
    rows, groups = scale.shape
    size = module.in_features // groups
    if module.bits == 8:
        exact = (offset == 0) & (scale.half().float() == scale)
        codes = codes + 128
        zero = torch.zeros_like(scale)
    else:
        zero = torch.round(-offset / scale)
        exact = ((scale.half().float() == scale) & (zero >= 0) & (zero <= 15)
                 & (-zero * scale == offset))
    if bool(exact.all()):
        return codes, scale, zero, exact
    fresh, fresh_scale, fresh_offset = fit_groups(module.dequantize(), size, module.bits, GRID)
    fresh = fresh.to(torch.int32) + (128 if module.bits == 8 else 0)
    fresh_zero = torch.zeros_like(fresh_scale) if module.bits == 8 else torch.round(
        -fresh_offset / fresh_scale)
    grouped = codes.view(rows, groups, size)
    codes = torch.where(exact[..., None], grouped, fresh.view(rows, groups, size))
    return (codes.view(rows, -1), torch.where(exact, scale, fresh_scale),
            torch.where(exact, zero, fresh_zero), exact)


def quantized_tensors(name: str, module: GroupedLinear, written: Written
                      ) -> dict[str, torch.Tensor]:
    """The format's tensors of one grouped module."""
    codes, scale, zero, exact = on_grid(module)
    written.groups += exact.numel()
    written.rerounded += int((~exact).sum())
    if not bool(exact.all()):
        rows, groups = scale.shape
        now = ((codes.view(rows, groups, -1).float() - (128 if module.bits == 8 else
                                                       zero[..., None]))
               * scale[..., None]).view(rows, -1)
        written.max_rounding = max(written.max_rounding,
                                   float((now - module.dequantize()).abs().max()))
    tensors = {f"{name}.weight_packed": pack_codes(codes, module.bits),
               f"{name}.weight_scale": scale.float().contiguous(),
               f"{name}.weight_shape": torch.tensor([module.out_features, module.in_features])}
    if module.bits == 4:  # signed zero point z - 8, offset by 8 again to pack: z
        tensors[f"{name}.weight_zero_point"] = pack_codes(
            zero.to(torch.int32).t().contiguous(), 4).t().contiguous()
    if module.bias is not None:
        tensors[f"{name}.bias"] = module.bias.detach().float().contiguous()
    written.modules.setdefault(module.bits, []).append(name)
    return tensors


def config_groups(written: Written, group_size: int) -> dict[str, Any]:
    """`quantization_config` of the written modules: a config group per bit width."""
    groups = {}
    for i, (bits, names) in enumerate(sorted(written.modules.items())):
        groups[f"group_{i}"] = {
            "targets": sorted(names), "format": FORMAT,
            "weights": {"num_bits": bits, "type": "int", "symmetric": bits == 8,
                        "strategy": "group", "group_size": group_size, "dynamic": False,
                        "actorder": None, "observer": "minmax"},
            "input_activations": None, "output_activations": None}
    return {"quant_method": "compressed-tensors", "format": FORMAT,
            "quantization_status": "compressed", "config_groups": groups, "ignore": [],
            "kv_cache_scheme": None, "sparsity_config": {}, "version": CHECKPOINT_VERSION}


def refuse_unheld(model: nn.Module) -> None:
    """Stop, in one line, at what the format (or a transformers config) cannot hold."""
    for name, module in model.named_modules():
        if isinstance(module, Sparse24Linear):
            raise CompressedTensorsError(f"{name}: 2:4 sparse weights are not written to "
                                         "compressed-tensors here; export format transformers")
        if is_experts(module):
            raise CompressedTensorsError(f"{name}: a mixture-of-experts layer is not written "
                                         "to compressed-tensors here; export format "
                                         "transformers")
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    for field_, path in (("intermediate_size", "mlp.gate_proj"),
                         ("num_attention_heads", "self_attn.q_proj"),
                         ("num_key_value_heads", "self_attn.k_proj")):
        widths = {layer.get_submodule(path).out_features for layer in layers}
        if len(widths) > 1:
            raise CompressedTensorsError(
                f"{field_}: pruning left {path} {len(widths)} different widths across "
                "layers, and a transformers config holds one; prune every layer alike "
                "(or export format gguf, whose arrays hold each layer's)")
    if not any(isinstance(m, GroupedLinear) for m in model.modules()):
        raise CompressedTensorsError("the model has no int8_grouped or int4_grouped weights: "
                                     "nothing to compress; quantize it with one of those first, "
                                     "or export format transformers")


def write_compressed_tensors(model: nn.Module, tokenizer: Any, folder: Path,
                             group_size: int) -> Written:
    """`model` (a transformers causal LM, its linears grouped) as a compressed-tensors folder,
    built under a temporary name beside `folder` and renamed when whole."""
    from safetensors.torch import save_file

    refuse_unheld(model)
    folder = Path(folder)
    written = Written(folder)
    tensors: dict[str, torch.Tensor] = {}
    head_name, head = "lm_head", getattr(model, "lm_head", None)
    tied = head is not None and torch.equal(dense_weight(head),
                                            dense_weight(model.get_input_embeddings()))
    bits = {m.bits for name, m in model.named_modules()
            if isinstance(m, GroupedLinear) and name != head_name and ".table" not in name}
    dense = {head_name} if not tied and getattr(head, "bits", None) not in bits else set()
    for name, module in model.named_modules():
        if name == head_name and (tied or dense):
            if dense:  # transformers reads one dense scheme: a head of another width is float
                tensors[f"{name}.weight"] = dense_weight(module)
        elif isinstance(module, GroupedEmbedding):
            tensors[f"{name}.weight"] = dense_weight(module)
        elif isinstance(module, GroupedLinear) and not name.endswith(".table"):
            tensors.update(quantized_tensors(name, module, written))
    held = tuple(f"{name}." for name, m in model.named_modules()
                 if isinstance(m, GroupedLinear | GroupedEmbedding) or name == head_name)
    for key, tensor in model.state_dict().items():  # the rest (norms) as they are
        if not key.startswith(held):
            tensors[key] = tensor.detach().float().clone()
    config = model.config.to_dict()
    quantization = config_groups(written, group_size)
    quantization["ignore"] = sorted(dense)
    config.update(tie_word_embeddings=tied, dtype="float32", quantization_config=quantization)
    config.pop("torch_dtype", None)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{folder.name}.") as tmp:
        partial = Path(tmp) / folder.name
        partial.mkdir()
        save_file(tensors, str(partial / WEIGHTS), metadata={"format": "pt"})
        (partial / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.save_pretrained(partial)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(partial)
        if folder.exists():
            shutil.rmtree(folder)
        partial.rename(folder)
    return written

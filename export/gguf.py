"""A causal LM (Llama architecture: SmolLM2, Llama, Mistral-style) as one GGUF file, the
format llama.cpp, Ollama and LM Studio read, written with the `gguf` package.

Weights go in llama.cpp's blocks of 32 inputs:
- `int8_grouped` → Q8_0 (an fp16 scale and 32 int8 codes a block). A group on that grid
  (symmetric, its scale an fp16 value: what `fit_groups` keeps for a GGUF's own Q8_0 groups
  and what a quantize stage with `grid: gguf` fits) is written exactly; any other group
  (affine, or a float32 scale) is re-rounded as llama.cpp's own quantize would round its
  float values, and the error is reported.
- `int4_grouped` → Q4_1 (an fp16 step and minimum, 32 4-bit codes): compress's 4-bit grid
  is Q4_1's, so every group is written exactly (its codes are even laid out as Q4 bytes).
- float weights → F32 (exact); norms → F32.
The input embedding (int8 groups) is Q8_0 like a linear; a tied head is no tensor of its own
(llama.cpp reads the embedding). Query and key rows are permuted as llama.cpp's converter
does (its rotary embedding pairs adjacent dimensions, transformers' halves).

Structured pruning: per-layer head counts and feed-forward widths are written as arrays
(llama.cpp reads them per layer), with the head size given explicitly. What llama.cpp
cannot hold is a `GgufError` naming it: 2:4 sparse weights, mixture-of-experts layers (not
written here yet), another architecture, a hidden size that changes between layers.

Tokenizer: byte-level BPE (GPT-2 style) from the model's tokenizer with its merges, special
tokens and chat template; llama.cpp's pre-tokenizer name (`tokenizer.ggml.pre`) is taken
from the GGUF the model came from where there is one, else "default".
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from export.errors import ExportError
from serve.causal_lm.runtime.grouped import (
    GroupedEmbedding,
    GroupedLinear,
    dense_weight,
    fit_groups,
)

BLOCK = 32  # inputs a Q8_0 / Q4_1 block holds
LAYER_TENSORS = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
LAYER_NORMS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
FILE_TYPES = {"float32": 0, "int8_grouped": 7, "int4_grouped": 3}  # llama_ftype: F32, Q8_0, Q4_1


class GgufError(ExportError):
    """What a GGUF cannot hold, in one line."""


@dataclass
class Written:
    """What writing the file did: each tensor's type, and the groups re-rounded."""

    path: Path
    types: dict[str, str] = field(default_factory=dict)
    groups: int = 0  # quantized groups written
    rerounded: int = 0  # of them, groups not on the target grid (re-rounded)
    max_rounding: float = 0.0  # the largest change a re-rounding made to a weight

    def facts(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for kind in self.types.values():
            counts[kind] = counts.get(kind, 0) + 1
        return {"gguf_tensor_types": ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                "gguf_groups": self.groups,
                "gguf_rerounded_groups": self.rerounded,
                "gguf_max_rounding": round(self.max_rounding, 9)}


def q8_0_blocks(module: GroupedLinear | None, weight: torch.Tensor | None,
                written: Written) -> np.ndarray:
    """rows x (34 bytes a block): a weight as Q8_0. The module's groups of 32 that lie on the
    grid are copied; every other group is rounded from its float value as llama.cpp rounds
    (scale amax / 127 to fp16, codes round(x / scale))."""
    if module is not None and module.group_size == BLOCK and module.bits == 8:
        qweight, scale, offset = module.sources()
        codes = qweight.view(qweight.shape[0], -1, BLOCK).to(torch.int8)
        scale, offset = scale.float(), offset.float()
        on_grid = (offset == 0) & (scale.half().float() == scale)
        values = module.dequantize().view(codes.shape)
    else:
        values = (module.dequantize() if module is not None else weight.float())
        values = values.reshape(values.shape[0], -1, BLOCK)
        codes, scale = None, None
        on_grid = torch.zeros(values.shape[:2], dtype=torch.bool)
    rows_, cols = values.shape[0], values.shape[1] * BLOCK
    fresh, fresh_scale, _ = fit_groups(values.reshape(rows_, cols), BLOCK, 8, "gguf")
    fresh = fresh.view(values.shape)  # llama.cpp's rounding of each group
    if codes is None:
        codes, scale = fresh, fresh_scale
    else:
        codes = torch.where(on_grid[..., None], codes, fresh)
        scale = torch.where(on_grid, scale, fresh_scale)
    off = ~on_grid
    written.groups += on_grid.numel()
    written.rerounded += int(off.sum())
    if off.any():
        change = (fresh.float() * fresh_scale[..., None] - values).abs()[off]
        written.max_rounding = max(written.max_rounding, float(change.max()))
    rows, blocks = scale.shape
    out = np.empty((rows, blocks, 2 + BLOCK), dtype=np.uint8)
    out[..., :2] = scale.half().numpy().view(np.uint8).reshape(rows, blocks, 2)
    out[..., 2:] = codes.numpy().view(np.uint8)
    return out.reshape(rows, blocks * (2 + BLOCK))


def q4_1_blocks(module: GroupedLinear, written: Written) -> np.ndarray:
    """rows x (20 bytes a block): a 4-bit grouped weight as Q4_1 (its step and minimum
    are fp16 values and its bytes Q4's layout already: copied)."""
    qweight, scale, offset = module.sources()
    if not (torch.equal(scale.half().float(), scale.float())
            and torch.equal(offset.half().float(), offset.float())):  # never from fit_groups
        raise GgufError("a 4-bit weight's steps or minimums are not float16 values; "
                        "quantize it again with this compress")
    rows, blocks = scale.shape
    out = np.empty((rows, blocks, 4 + BLOCK // 2), dtype=np.uint8)
    out[..., 0:2] = scale.half().numpy().view(np.uint8).reshape(rows, blocks, 2)
    out[..., 2:4] = offset.half().numpy().view(np.uint8).reshape(rows, blocks, 2)
    out[..., 4:] = qweight.view(rows, blocks, BLOCK // 2).numpy()
    written.groups += rows * blocks
    return out.reshape(rows, blocks * (4 + BLOCK // 2))


def float_weights(module: nn.Module) -> np.ndarray:
    """A linear's or embedding's float32 weight values (grouped ones dequantized)."""
    return dense_weight(module).numpy()


def permuted(rows: np.ndarray | torch.Tensor, heads: int) -> Any:
    """Query or key rows (heads x head size, then anything per row) in llama.cpp's order:
    each head's two halves interleaved (transformers rotates halves, llama.cpp pairs)."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(
        shape)


def weight_tensor(module: nn.Module, name: str, written: Written, heads: int | None = None
                  ) -> tuple[np.ndarray, Any]:
    """(data, gguf type or None for float32) of a linear or embedding `module`."""
    import gguf

    types = gguf.GGMLQuantizationType
    table = module.table if isinstance(module, GroupedEmbedding) else module
    if isinstance(table, GroupedLinear):
        if table.bits == 4:
            data, kind = q4_1_blocks(table, written), types.Q4_1
        else:
            data, kind = q8_0_blocks(table, None, written), types.Q8_0
    elif type(module) in (nn.Linear, nn.Embedding):
        data, kind = module.weight.detach().float().numpy(), None
    else:
        raise GgufError(f"{name}: a {type(module).__name__}, which llama.cpp cannot hold (a "
                        "GGUF takes float, int8_grouped and int4_grouped weights; 2:4 sparse "
                        "and expert layers are not written); export format transformers")
    if heads is not None:
        data = permuted(data, heads)
    written.types[name] = kind.name if kind is not None else "F32"
    return np.ascontiguousarray(data), kind


def shapes(model: nn.Module) -> dict[str, Any]:
    """The architecture's sizes, per layer where pruning made them differ."""
    config = model.config
    layers = model.model.layers
    head_size = int(getattr(config, "head_dim", None)
                    or config.hidden_size // config.num_attention_heads)
    heads = [layer.self_attn.q_proj.out_features // head_size for layer in layers]
    kv_heads = [layer.self_attn.k_proj.out_features // head_size for layer in layers]
    widths = [layer.mlp.gate_proj.out_features for layer in layers]
    hidden = {layer.self_attn.o_proj.out_features for layer in layers}
    if hidden != {config.hidden_size}:
        raise GgufError(f"the hidden size changes between layers ({sorted(hidden)}); "
                        "llama.cpp needs one")
    return {"head_size": head_size, "heads": heads, "kv_heads": kv_heads, "widths": widths}


def one_or_all(values: list[int]) -> int | list[int]:
    return values[0] if len(set(values)) == 1 else values


def source_pre_tokenizer(source: Path | None) -> str | None:
    """`tokenizer.ggml.pre` of the GGUF the model came from (None: none)."""
    if source is None or not Path(source).is_file():
        return None
    import gguf

    field_ = gguf.GGUFReader(str(source)).fields.get("tokenizer.ggml.pre")
    return field_.contents() if field_ is not None else None


def add_tokenizer(writer: Any, tokenizer: Any, vocab_size: int, pre: str | None) -> None:
    """The BPE vocabulary, its merges, special tokens and chat template."""
    import gguf

    if getattr(tokenizer, "is_fast", False) is False:
        raise GgufError("the tokenizer is not a fast (tokenizer.json) one; GGUF export reads "
                        "its BPE vocabulary and merges from tokenizer.json")
    vocab = tokenizer.get_vocab()
    model_type = tokenizer.backend_tokenizer.to_str()
    if '"type":"BPE"' not in model_type.replace(" ", ""):
        raise GgufError("the tokenizer is not byte-level BPE; GGUF export writes GPT-2 style "
                        "vocabularies only")
    by_id = {i: token for token, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    special = set(tokenizer.all_special_tokens)
    tokens, kinds = [], []
    for i in range(vocab_size):
        token = by_id.get(i, f"[PAD{i}]")
        tokens.append(token)
        if i not in by_id:
            kinds.append(gguf.TokenType.UNUSED)
        elif token in added:
            kinds.append(gguf.TokenType.CONTROL if token in special
                         else gguf.TokenType.USER_DEFINED)
        else:
            kinds.append(gguf.TokenType.NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre or "default")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size).add_to_gguf(
            writer, quiet=True)


def write_gguf(model: nn.Module, tokenizer: Any, path: Path, scheme: str | None,
               name: str, source_gguf: Path | None = None) -> Written:
    """`model` (a transformers Llama, its linears float or grouped) as the GGUF `path`,
    written beside it under a temporary name and renamed when whole."""
    import gguf

    config = model.config
    kind = (getattr(config, "architectures", None) or [type(model).__name__])[0]
    if kind not in ARCHITECTURES:
        raise GgufError(f"a {kind}: GGUF export writes the Llama architecture "
                        f"({', '.join(ARCHITECTURES)})")
    if any(getattr(layer, "mlp", None) is not None and not hasattr(layer.mlp, "gate_proj")
           for layer in model.model.layers):
        raise GgufError("a mixture-of-experts layer: GGUF export does not write llama.cpp's "
                        "expert tensors yet; export format transformers")
    sizes = shapes(model)
    written = Written(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp")
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES.get(scheme or "float32", 0))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(len(model.model.layers))
    writer.add_feed_forward_length(one_or_all(sizes["widths"]))
    writer.add_head_count(one_or_all(sizes["heads"]))
    writer.add_head_count_kv(one_or_all(sizes["kv_heads"]))
    writer.add_key_length(sizes["head_size"])
    writer.add_value_length(sizes["head_size"])
    writer.add_rope_dimension_count(sizes["head_size"])
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or (
        (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    vocab_size = int(config.vocab_size)
    writer.add_vocab_size(vocab_size)
    add_tokenizer(writer, tokenizer, vocab_size, source_pre_tokenizer(source_gguf))

    def add(name_: str, data: np.ndarray, qtype: Any) -> None:
        if qtype is None:
            writer.add_tensor(name_, data.astype(np.float32))
        else:
            writer.add_tensor(name_, data, raw_dtype=qtype)

    add("token_embd.weight", *weight_tensor(model.model.embed_tokens, "token_embd.weight",
                                             written))
    for i, layer in enumerate(model.model.layers):
        for source, target in LAYER_TENSORS.items():
            module = layer.get_submodule(source)
            if getattr(module, "bias", None) is not None:
                raise GgufError(f"model.layers.{i}.{source} has a bias, which llama.cpp's "
                                "Llama does not read")
            heads = (sizes["heads"][i] if target == "attn_q" else
                     sizes["kv_heads"][i] if target == "attn_k" else None)
            tensor = f"blk.{i}.{target}.weight"
            add(tensor, *weight_tensor(module, tensor, written, heads))
        for source, target in LAYER_NORMS.items():
            tensor = f"blk.{i}.{target}.weight"
            add(tensor, layer.get_submodule(source).weight.detach().float().numpy(), None)
            written.types[tensor] = "F32"
    add("output_norm.weight", model.model.norm.weight.detach().float().numpy(), None)
    written.types["output_norm.weight"] = "F32"
    head, embed = model.lm_head, model.model.embed_tokens
    if not (getattr(config, "tie_word_embeddings", False)
            and np.array_equal(float_weights(head), float_weights(embed))):
        add("output.weight", *weight_tensor(head, "output.weight", written))
    # else llama.cpp reads the embedding as the head, as the source model did
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return written

"""FLOPs of one encoder forward (BERT-like and DistilBERT configs, a pruned model's shapes
from its structure.json): the work the classifier and embedding tables divide by a latency
for the share of the int8 GEMM peak. Pure arithmetic over config dicts (no torch import)."""

from __future__ import annotations

from typing import Any

SEQ_LEN = 128  # the fixed-length sweep's tokens ...
FLOPS_BATCH = 8  # ... and batch: FLOPs and the share of the int8 peak are quoted at 8 x 128

# config.json names of the shapes: BERT-like first, DistilBERT's second
_KEYS = {"layers": ("num_hidden_layers", "n_layers"), "hidden": ("hidden_size", "dim"),
         "intermediate": ("intermediate_size", "hidden_dim"),
         "heads": ("num_attention_heads", "n_heads")}


def shapes_of(config: dict[str, Any]) -> dict[str, int]:
    """Layers, hidden, intermediate and heads of a Hugging Face encoder config; KeyError
    names what is missing."""
    found = {}
    for name, keys in _KEYS.items():
        value = next((config[k] for k in keys if config.get(k)), None)
        if value is None:
            raise KeyError(f"config has none of {', '.join(keys)}")
        found[name] = int(value)
    return found


def forward_flops(config: dict[str, Any], batch: int = FLOPS_BATCH,
                  seq: int = SEQ_LEN, structure: dict[str, Any] | None = None) -> float:
    """FLOPs of one encoder forward on `batch` x `seq` tokens: 2 x (the layers' linear
    weights) x tokens, plus the attention products (QK^T and AV: 2 x 2 x batch x heads x
    seq^2 x head_dim per layer). Embeddings, norms, softmax, pooler and head are left out
    (under 0.1% for MiniLM). `structure` (a pruned model's structure.json) gives the shapes
    pruning left: its linears' [out, in] and its attention modules' head counts."""
    s = shapes_of(config)
    tokens = batch * seq
    head_dim = s["hidden"] // s["heads"]
    total = 0.0
    for layer in range(s["layers"]):
        weights = 0
        for suffix, (out, into) in LAYER_LINEARS.items():
            shape = _pruned(structure, "modules", layer, suffix)
            weights += shape[0] * shape[1] if shape else s[out] * s[into]
        heads = _pruned(structure, "attention_heads", layer, "attention.self") or s["heads"]
        total += 2 * weights * tokens + 2 * 2 * batch * heads * seq * seq * head_dim
    return float(total)


# a BERT layer's linears, by the end of their module name: (out, in) in shapes_of's names
LAYER_LINEARS = {"attention.self.query": ("hidden", "hidden"),
                 "attention.self.key": ("hidden", "hidden"),
                 "attention.self.value": ("hidden", "hidden"),
                 "attention.output.dense": ("hidden", "hidden"),
                 "intermediate.dense": ("intermediate", "hidden"),
                 "output.dense": ("hidden", "intermediate")}


def _pruned(structure: dict[str, Any] | None, section: str, layer: int, suffix: str) -> Any:
    """What `structure`'s section says of layer `layer`'s module ending in `suffix`."""
    ending = f"layer.{layer}.{suffix}"
    return next((value for name, value in ((structure or {}).get(section) or {}).items()
                 if name == ending or name.endswith("." + ending)), None)

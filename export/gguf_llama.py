"""llama.cpp's own view of a GGUF file, run by a Python that has llama-cpp-python (numpy and
the standard library besides; no torch, no compress): `python gguf_llama.py < spec.json`.

The spec: {"gguf": path, "sequences": [[token ids], ...], "logit_positions": N,
"out": folder, "threads": T, "kv_cache": "f16" | "f32"} (the KV cache's type: llama.cpp's
default is f16; f32 keeps keys and values as a float32 model does). For each sequence
llama.cpp evaluates the tokens with every position's logits kept; the first
`logit_positions` positions' logits over all sequences go to `<out>/logits.npy` (positions
x vocabulary, float32), and each sequence's summed negative log-likelihood of its tokens
after the first and their count are printed as one JSON line: {"nll": [...], "tokens":
[...], "llama_cpp": version}.
"""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

KV_TYPES = {"f32": 0, "f16": 1}  # ggml's type ids (GGML_TYPE_F32, GGML_TYPE_F16)


def log_softmax(rows):  # noqa: ANN001, ANN201 - numpy arrays
    import numpy as np

    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def main() -> int:
    import numpy as np
    from llama_cpp import Llama

    spec = json.loads(sys.stdin.read())
    longest = max(len(s) for s in spec["sequences"])
    kv_type = KV_TYPES[spec.get("kv_cache", "f16")]
    model = Llama(spec["gguf"], n_ctx=max(longest, 64), logits_all=True, verbose=False,
                  n_threads=int(spec.get("threads") or 1), n_batch=max(longest, 64),
                  type_k=kv_type, type_v=kv_type)
    kept, wanted = [], int(spec.get("logit_positions") or 0)
    nll, counts = [], []
    for tokens in spec["sequences"]:
        model.reset()
        model.eval(tokens)
        # a copy: llama-cpp-python's scores buffer is overwritten by the next sequence
        scores = np.array(model.scores[:len(tokens)], dtype=np.float32, copy=True)
        if sum(len(k) for k in kept) < wanted:
            kept.append(scores[:wanted - sum(len(k) for k in kept)])
        logp = log_softmax(scores[:-1].astype(np.float64))
        nll.append(float(-logp[np.arange(len(tokens) - 1), tokens[1:]].sum()))
        counts.append(len(tokens) - 1)
    if kept:
        np.save(Path(spec["out"]) / "logits.npy", np.concatenate(kept))
    print(json.dumps({"nll": nll, "tokens": counts,
                      "llama_cpp": metadata.version("llama-cpp-python")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

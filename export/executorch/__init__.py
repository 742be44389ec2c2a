"""Format executorch: one ExecuTorch program (`model.pte`) lowered to XNNPACK, which
`executorch.runtime` runs on a CPU. `encoder`: classifiers, embedders and rerankers (the
export folder's writer, whose names are the package's, and what serve.runtimes.load_executorch
reads); `decoder`: a causal LM over a static KV cache, one token a call; `lowering`: what
both share."""

from export.executorch.encoder import MAX_BATCH, QUANTIZED, export  # noqa: F401  (the format's names)
from export.executorch.lowering import EXTRA, FILE  # noqa: F401  (the format's names)

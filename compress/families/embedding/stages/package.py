"""Stage `package` on an embedding model: a TorchServe `.mar` of an embedding export (ONNX,
ONNX Runtime int8, AOTInductor, TorchScript) with the embedding handler, ready for `compress
serve`: compress's own route and OpenAI's `v1/embeddings`, one forward pass per batch.

The archive holds the export folder's files (the exported file, `export.json` with its
`embedding` block, the tokenizer), the `serve/` package with serve's own modules and
`serve/embedding/` (the handler and its requests), and a generated root module,
`embedding_handler.py`, that defines the one class TorchServe and LitServe look for there
(they import the handler by its file name from the archive's root)."""

from __future__ import annotations

from compress.recipe.kinds.package import PackageConfig
from compress.stages.context import StageContext, State
from compress.stages.package import encoder_archive

HANDLER = "serve.embedding.handler:EmbeddingHandler"
ENTRY = "embedding_handler.py"  # the archive's root module that defines the handler's class
# what the run measured of the packaged file, copied into the archive's compress.json:
# how close its embeddings stay to the float model's, and how fast it embeds
SERVED_METRICS = ("fidelity", "fidelity_p1", "recall_at_10", "knn_accuracy",
                  "parity_fidelity", "parity_fidelity_p1", "parity_max_abs_diff",
                  "latency_ms_b1", "latency_ms_b8", "latency_ms_b32", "real_items_per_s_b1",
                  "real_items_per_s_b32", "dimensions", "runtime_threads")


def run(state: State, cfg: PackageConfig, ctx: StageContext) -> State:
    """Archive the embedding export entering the stage with the embedding handler."""
    return encoder_archive(state, cfg, ctx, "embedding", HANDLER, ENTRY, SERVED_METRICS)

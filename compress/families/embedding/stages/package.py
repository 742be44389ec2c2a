"""Stage `package` on an embedding model: a TorchServe `.mar` of an embedding export (ONNX,
ONNX Runtime int8, AOTInductor, TorchScript) with the embedding handler, ready for `compress
serve`: compress's own route and OpenAI's `v1/embeddings`, one forward pass per batch.

The archive holds the export folder's files (the exported file, `export.json` with its
`embedding` block, the tokenizer), the `serve/` package with serve's own modules and
`serve/embedding/` (the handler and its requests), and a generated root module,
`embedding_handler.py`, that defines the one class TorchServe and LitServe look for there
(they import the handler by its file name from the archive's root)."""

from __future__ import annotations

import shutil

from compress.recipe.kinds.package import PackageConfig
from compress.serving.archive import code_tree
from compress.stages.context import StageContext, State
from compress.stages.package import archive
from serve.worker_threads import worker_threads

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
    handler = {"task": "embedding", "threads": worker_threads(cfg.threads, cfg.workers),
               "max_text_chars": cfg.max_text_chars, "length_buckets": cfg.length_buckets}
    code = code_tree(ctx.folder / ".archive_code", HANDLER, ENTRY)
    try:
        return archive(state, cfg, ctx, handler, HANDLER, SERVED_METRICS, code=code)
    finally:
        shutil.rmtree(code[0].parent, ignore_errors=True)

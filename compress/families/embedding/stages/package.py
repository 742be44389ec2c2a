"""Stage `package` on an embedding model: a TorchServe `.mar` of an embedding export (ONNX,
ONNX Runtime int8, AOTInductor, TorchScript) with the embedding handler, ready for `compress
serve`: compress's own route and OpenAI's `v1/embeddings`, one forward pass per batch.

The archive holds the export folder's files (the exported file, `export.json` with its
`embedding` block, the tokenizer), the `embedding/` package (`serve/embedding`: the handler
and its requests), the shared serving modules at its root, and a generated root module,
`embedding_handler.py`, that defines the one class TorchServe and LitServe look for there
(they import the handler by its file name from the archive's root)."""

from __future__ import annotations

import shutil
from pathlib import Path

import serve.embedding as embedding_code
from compress.recipe.kinds.package import PackageConfig
from compress.serving.archive import SERVE
from compress.stages.context import StageContext, State
from compress.stages.package import archive
from serve.worker_threads import worker_threads

PACKAGE = SERVE / "embedding"  # `embedding/` in the archive
MODULES = tuple(PACKAGE / f"{name}.py" for name in ("__init__", *embedding_code.SERVING_MODULES))
ENTRY = "embedding_handler.py"
ENTRY_SOURCE = '''"""The archive's handler module (written by compress's package stage):
TorchServe and LitServe import it by its file name and take the one class defined in it."""

from embedding.handler import EmbeddingHandler as _Handler


class EmbeddingHandler(_Handler):
    """The embedding family's handler (`embedding/handler.py`)."""
'''
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
    tree, entry = archive_tree(ctx.folder / ".archive_tree")
    try:
        return archive(state, cfg, ctx, handler, entry, (), SERVED_METRICS, trees=(tree,))
    finally:
        shutil.rmtree(tree.parent, ignore_errors=True)


def archive_tree(folder: Path) -> tuple[Path, Path]:
    """(a folder holding the archive's `embedding/` package, the generated entry module)
    under `folder`."""
    shutil.rmtree(folder, ignore_errors=True)
    package = folder / "tree" / PACKAGE.name
    package.mkdir(parents=True)
    for module in MODULES:
        shutil.copy2(module, package / module.name)
    entry = folder / ENTRY
    entry.write_text(ENTRY_SOURCE)
    return package.parent, entry

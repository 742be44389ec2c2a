"""Stage `package` on a reranker: a TorchServe `.mar` of a reranker export (ONNX, ONNX
Runtime int8, AOTInductor, TorchScript) with the reranker handler, ready for `compress serve`:
compress's own route and `v1/rerank` (Cohere's and Jina's shape), every pair of a batch's
requests in passes of similar length.

The archive holds the export folder's files (the exported file, `export.json` with its
`reranker` block, the tokenizer), the `serve/` package with serve's own modules and
`serve/reranker/` (the handler and its requests), and a generated root module,
`reranker_handler.py`, that defines the one class TorchServe and LitServe look for there."""

from __future__ import annotations

from compress.recipe.kinds.package import PackageConfig
from compress.stages.context import StageContext, State
from compress.stages.package import encoder_archive

HANDLER = "serve.reranker.handler:RerankerHandler"
ENTRY = "reranker_handler.py"  # the archive's root module that defines the handler's class
# what the run measured of the packaged file, copied into the archive's compress.json
SERVED_METRICS = ("ndcg_at_10", "mrr_at_10", "kendall_tau", "score_max_abs_diff",
                  "parity_kendall_tau", "parity_max_abs_diff", "latency_ms_b1",
                  "latency_ms_b8", "latency_ms_b32", "real_items_per_s_b1",
                  "real_items_per_s_b32", "runtime_threads")


def run(state: State, cfg: PackageConfig, ctx: StageContext) -> State:
    """Archive the reranker export entering the stage with the reranker handler."""
    return encoder_archive(state, cfg, ctx, "reranking", HANDLER, ENTRY, SERVED_METRICS)

"""The causal-LM family's runtime: what a causal-LM export folder and its archive ship.

In the repository this is `serve.causal_lm`; in an export folder or an unpacked archive it is
the top-level package `causal_lm` (the folder on `sys.path`), so its modules import each other
relatively and never lie flat beside a handler (`requests.py` and `openai.py` would shadow
the libraries of those names). The shared serving modules (`handler_metrics`, `http_answers`,
`worker_threads`) lie at the archive's root. Nothing is imported here: `causal_lm.runtime`
loads without TorchServe.
"""

# the modules an export folder ships (`causal_lm/` beside the weights)
RUNTIME_MODULES = ("runtime", "decode", "static_cache", "attention", "grouped",
                   "grouped_kernels", "sparse24", "fused", "speculative", "tensor_parallel",
                   "pipeline", "pipeline_parallel", "expert_parallel", "expert_dispatch",
                   "expert_compare", "experts")
# the modules an archive adds: the handler, its requests and answers, the continuous batch
SERVING_MODULES = ("handler", "requests", "replies", "openai", "openai_request", "choices",
                   "tools", "grammar", "picking", "batcher", "rows", "buckets", "placement",
                   "prefill", "prefix_cache", "compiled_graphs", "aot_steps")

"""What ships inside a served archive or beside an exported folder (no compress imports).

An archive ships this package as `serve/`: its own modules, which every handler shares (the
runtime loaders, request batching, HTTP answers, worker threads, metrics, the encoder
kernels), and its family's package whole: `classifier/`, `embedding/` or `causal_lm/`
(`runtime/` and `server/`). A causal-LM export folder ships `causal_lm/runtime/` alone, as the
package `causal_lm.runtime`. The folders are the list of what ships; the modules import one
another as `serve.<module>` here and in an archive, and relatively inside a family's package.
"""

"""What ships inside a served archive or beside an exported folder (no compress imports): the
classifier handler, the runtime loaders and the modules every handler shares, at an archive's
root; `causal_lm/`, the causal-LM family's package, as the package `causal_lm` there.
"""

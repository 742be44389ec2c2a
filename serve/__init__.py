"""What ships inside a served archive or beside an exported folder (no compress imports): the
classifier handler, the runtime loaders and the modules every handler shares, at an archive's
root; `causal_lm/` and `embedding/`, those families' packages, as the packages `causal_lm`
and `embedding` there.
"""

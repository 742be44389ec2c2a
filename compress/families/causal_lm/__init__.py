"""The causal-LM family: how it loads (`model`, `folder`), what it measures (`family`,
`generation`), its algorithms (`algorithms/`: distillation, equalization, pruning, QAT) and how
each stage kind runs on it (`stages/`, named by `compress.recipe.family_specs`). Its runtime,
what an export folder and an archive ship, is `serve.causal_lm`.
"""

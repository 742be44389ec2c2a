"""Stage run modules: one shared `run(state, cfg, ctx) -> state` per kind (the classifier's
path), and `context`; a family with its own way to run a kind has it in its package
(compress.families.<family>.stages); configs and specs are in compress.recipe.kinds.
"""

"""Stage run modules: one `run(state, cfg, ctx) -> state` per kind (and per model family);
their configs and specs are in compress.recipe.kinds.
"""

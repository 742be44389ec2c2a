"""Model families, one package each (`classifier/`, `causal_lm/`): how a kind of model loads,
what data it takes, what is measured and how each stage kind runs on it (their specs are in
compress.recipe.family_specs).
"""

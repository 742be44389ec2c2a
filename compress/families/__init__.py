"""Model families' work: how a classifier or a causal LM loads, what data it takes and what is
measured (their specs are in compress.recipe.family_specs).
"""

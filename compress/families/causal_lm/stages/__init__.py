"""How each stage kind runs on a causal LM: one module per kind (`compile`, `distill`,
`export`, `finetune`, `package`, `prune`, `quantize`), named by the family's `runners` in
`compress.recipe.family_specs`, plus the export's checks of its tensor-, pipeline- and
expert-parallel splits (`export_parallel`).
"""

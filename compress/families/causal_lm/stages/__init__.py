"""How each stage kind runs on a causal LM: one module per kind (`compile`, `distill`,
`export`, `finetune`, `package`, `prune`, `quantize`), named by the family's `runners` in
`compress.recipe.family_specs`, plus the export's tensor- and pipeline-parallel checks.
"""

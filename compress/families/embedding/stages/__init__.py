"""How each stage kind runs on an embedding model: one module per kind (`compile`,
`quantize`, `export`, `package`), named by the family's `stages` in
`compress.recipe.family_specs`. Kinds without a module here do not take embedding models.
"""

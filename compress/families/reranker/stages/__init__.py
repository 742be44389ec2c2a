"""How each stage kind runs on a reranker: one module per kind (`distill`, `prune`,
`quantize`, `export`, `search`, `package`), named by the family's `stages` in
`compress.recipe.family_specs`. Kinds without a module here do not take rerankers yet."""

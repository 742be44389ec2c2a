"""The reranking family: sentence-transformers CrossEncoder folders, scored on query-document
pairs (`compress.recipe.family_specs`)."""

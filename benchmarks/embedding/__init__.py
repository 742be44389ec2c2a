"""Embedding peers: an embedding run's exports against sentence-transformers and fastembed
(`peers`), and its served archive against infinity-emb (`served`)."""
